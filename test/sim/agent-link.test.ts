import { createServer } from 'node:net'
import t, { type Test } from 'tap'
import { oracleText } from '../../sim/src/oracle.js'
import { build, eventually, MODEL, parseSse, type Built } from './build.js'
import { FakeAgent } from './fake-agent.js'

/*
 * `--kv agent` through the real AgentLink and AgentClient, against fake agents over loopback
 * HTTP (test/sim/fake-agent.ts): leases and their events, pulls, failed and aborted pulls'
 * tainted blocks, the failure policy, an agent restart, an agent that is not there.
 */

const blockBytes = 16 * 32
const body = { model: MODEL, prompt: 'a prompt whose KV moves through two transfer agents', max_tokens: 5 }
const want = oracleText({ kind: 'completion', prompt: body.prompt, maxTokens: 5 })

type Tap = Test

interface Info {
  usedBlocks: number
  leases: number
  taintedBlocks: number
  agentAttached: boolean
}

async function info(b: Built): Promise<Info> {
  return (await b.app.inject({ url: '/sim/info' })).json()
}

async function setup(t: Tap, dConfig: Record<string, unknown> = {}) {
  const memories = new Map<string, Uint8Array>()
  const peers = new Map<number, FakeAgent>()
  const pAgent = new FakeAgent(memories, peers)
  const dAgent = new FakeAgent(memories, peers)
  await pAgent.listen()
  await dAgent.listen()
  t.teardown(async () => {
    await pAgent.app.close()
    await dAgent.app.close()
  })
  const common = { kv: 'agent', numGpuBlocksOverride: 64 }
  memories.set('p0', new Uint8Array(64 * blockBytes))
  memories.set('d0', new Uint8Array(64 * blockBytes))
  const p = build(t, { ...common, role: 'prefill', engineId: 'p0', agentUrl: pAgent.url, shmName: '/test-p0' }, { kvMemory: memories.get('p0') as Uint8Array })
  const d = build(t, { ...common, role: 'decode', engineId: 'd0', agentUrl: dAgent.url, shmName: '/test-d0', ...dConfig }, { kvMemory: memories.get('d0') as Uint8Array })
  await p.app.simKv?.whenReady?.()
  await d.app.simKv?.whenReady?.()
  const prefill = async (): Promise<Record<string, unknown>> => {
    const r = await p.app.inject({ method: 'POST', url: '/v1/completions', payload: { ...body, max_tokens: 1, kv_transfer_params: { do_remote_decode: true } } })
    t.equal(r.statusCode, 200, 'prefill leg')
    return r.json().kv_transfer_params
  }
  const decode = (params: Record<string, unknown>, extra: Record<string, unknown> = {}) =>
    d.app.inject({ method: 'POST', url: '/v1/completions', payload: { ...body, ...extra, kv_transfer_params: params } })
  return { pAgent, dAgent, p, d, prefill, decode }
}

t.test('attach, lease, pull: the oracle text, and P frees its blocks on lease_ended', async (t) => {
  const { pAgent, dAgent, p, d, prefill, decode } = await setup(t)
  t.match(pAgent.attached, { engineId: 'p0', role: 'prefill', shmName: '/test-p0', blockSize: 16, bytesPerToken: 32, numBlocks: 64 })
  t.equal((await p.app.inject({ url: '/health' })).statusCode, 200)
  const params = await prefill()
  t.match(params, { remote_host: '127.0.0.1', remote_port: pAgent.port, remote_engine_id: 'p0' }, "the agent's address")
  t.type(params.remote_blocks_expiry_time, 'number')
  t.ok(pAgent.leases.has(params.remote_request_id as string), 'leased at the agent under the internal id')
  t.match(await info(p), { leases: 1, usedBlocks: 1 })

  const r = await decode(params)
  t.equal(r.statusCode, 200)
  t.equal(r.json().choices[0].text, want)
  t.match(dAgent.pulls[0], { remoteEngineId: 'p0', remoteRequestId: params.remote_request_id, remotePort: pAgent.port, remoteBlocksExpiryTime: params.remote_blocks_expiry_time })
  t.match(await info(d), { usedBlocks: 0, taintedBlocks: 0 })
  await eventually(t, 'P freed its blocks on read_done', async () => (await info(p)).usedBlocks === 0)
  t.match(await info(p), { leases: 0 })
  t.match((await d.app.inject({ url: '/sim/requests' })).json().requests[0], { kvLoad: 'ok' })

  // An expiry counts in vLLM's expired-KV metric.
  const unread = await prefill()
  pAgent.endLease(unread.remote_request_id as string, 'expired')
  await eventually(t, 'expired lease freed', async () => (await info(p)).usedBlocks === 0)
  t.match((await p.app.inject({ url: '/metrics' })).body, 'vllm:nixl_num_kv_expired_reqs_total{model_name="handoff/sim-1",engine="0"} 1')
})

t.test('a failed pull: 500 naming the agent code; tainted blocks wait for pull_quiesced', async (t) => {
  const { dAgent, d, prefill, decode } = await setup(t)
  const params = await prefill()
  dAgent.onPull = async () => ({ status: 502, code: 'XFA_ERR_READ_FAILED', tainted: true, quiesce: false })
  const r = await decode(params)
  t.equal(r.statusCode, 500)
  t.match(r.json().error, { code: 'SIM_ERR_KV_LOAD_FAILED', message: /XFA_ERR_READ_FAILED/ })
  t.match(await info(d), { usedBlocks: 1, taintedBlocks: 1 }, 'held while a READ may still write')
  t.match((await d.app.inject({ url: '/sim/requests' })).json().requests[0], { kvLoad: 'failed', kvLoadError: 'XFA_ERR_READ_FAILED' })
  dAgent.quiesce(dAgent.pulls[0]?.requestId as string)
  await eventually(t, 'freed on pull_quiesced', async () => (await info(d)).usedBlocks === 0)
  t.match(await info(d), { taintedBlocks: 0 })

  // pull_quiesced pushed before the answer: freed once, whichever arrives first.
  dAgent.onPull = async () => ({ status: 410, code: 'XFA_ERR_KV_EXPIRED', tainted: false, quiesce: true })
  for (let i = 0; i < 5; i++) {
    const s = await decode(params, { stream: true })
    t.equal(s.statusCode, 200)
    t.match(parseSse(s.body), { done: true, frames: [{ error: { code: 'SIM_ERR_KV_LOAD_FAILED', message: /XFA_ERR_KV_EXPIRED/ } }] })
  }
  await eventually(t, 'all freed', async () => (await info(d)).usedBlocks === 0)
  t.notOk(d.logs.some((l) => /freed twice/.test(JSON.stringify(l))), 'no double free')
  t.match((await d.app.inject({ url: '/metrics' })).body, 'vllm:nixl_num_failed_transfers_total{model_name="handoff/sim-1",engine="0"} 6')
})

t.test('kv_load_failure_policy recompute: the oracle text from a local prefill', async (t) => {
  const { dAgent, d, prefill, decode } = await setup(t, { kvLoadFailurePolicy: 'recompute' })
  const params = await prefill()
  dAgent.onPull = async () => ({ status: 410, code: 'XFA_ERR_PEER_GONE', tainted: false, quiesce: true })
  const r = await decode(params)
  t.equal(r.statusCode, 200)
  t.equal(r.json().choices[0].text, want)
  t.match((await d.app.inject({ url: '/sim/requests' })).json().requests[0], { kvLoad: 'recomputed', kvLoadError: 'XFA_ERR_PEER_GONE' })
  await eventually(t, 'blocks freed', async () => (await info(d)).usedBlocks === 0)
})

t.test('an aborted decode aborts the pull; its blocks wait for pull_quiesced', async (t) => {
  const { dAgent, d, prefill } = await setup(t)
  const params = await prefill()
  let agentSawAbort = false
  dAgent.onPull = (_body, signal) =>
    new Promise((resolve) => {
      signal.addEventListener('abort', () => {
        agentSawAbort = true
        resolve(undefined)
      })
    })
  const url = await d.app.listen({ host: '127.0.0.1', port: 0 })
  const client = new AbortController()
  const pending = fetch(`${url}/v1/completions`, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify({ ...body, kv_transfer_params: params }),
    signal: client.signal,
  }).catch((err: unknown) => err)
  await eventually(t, 'pull reached the agent', async () => dAgent.pulls.length === 1)
  client.abort()
  await pending
  await eventually(t, 'the agent saw the call closed', async () => agentSawAbort)
  await eventually(t, 'blocks tainted', async () => (await info(d)).taintedBlocks === 1)
  t.equal((await info(d)).usedBlocks, 1)
  dAgent.quiesce(dAgent.pulls[0]?.requestId as string)
  await eventually(t, 'freed on pull_quiesced', async () => (await info(d)).usedBlocks === 0)
})

t.test('the agent restarts: attach again and lease every held block afresh, never free them', async (t) => {
  const { pAgent, p, prefill, decode } = await setup(t)
  const params = await prefill()
  const id = params.remote_request_id as string
  const before = pAgent.agentId
  pAgent.restart()
  await eventually(t, 'attached and leased again', async () => pAgent.attached !== undefined && pAgent.leases.has(id))
  t.not(pAgent.agentId, before)
  t.match(await info(p), { usedBlocks: 1, leases: 1 }, 'the blocks stay pinned')
  const r = await decode(params)
  t.equal(r.json().choices[0].text, want, 'the decoder still reads the right bytes')
  await eventually(t, 'freed on the new agent’s read_done', async () => (await info(p)).usedBlocks === 0)

  // Not attached (as after a restart the events loop has not seen yet): attach, then retry once.
  pAgent.detached = true
  const attaches = pAgent.calls.filter((c) => c === 'POST /v1/engine/attach').length
  await prefill()
  t.equal(pAgent.calls.filter((c) => c === 'POST /v1/engine/attach').length, attaches + 1)
  t.match(await info(p), { leases: 1 })
})

t.test('a failed lease: 500, the blocks are freed', async (t) => {
  const { pAgent, p } = await setup(t)
  pAgent.failLeases = { status: 409, code: 'XFA_ERR_BLOCKS_LEASED' }
  const r = await p.app.inject({ method: 'POST', url: '/v1/completions', payload: { ...body, max_tokens: 1, kv_transfer_params: { do_remote_decode: true } } })
  t.equal(r.statusCode, 500)
  t.match(r.json().error, { code: 'SIM_ERR_KV_LEASE_FAILED', message: /XFA_ERR_BLOCKS_LEASED/ })
  t.match(await info(p), { usedBlocks: 0, leases: 0 })
})

t.test('no agent: /health 503, prefill 503, a pull never sent frees its blocks at once', async (t) => {
  const port = await new Promise<number>((resolve) => {
    const s = createServer().listen(0, '127.0.0.1', () => {
      const { port } = s.address() as { port: number }
      s.close(() => resolve(port))
    })
  })
  const agentUrl = `http://127.0.0.1:${port}`
  const p = build(t, { kv: 'agent', role: 'prefill', agentUrl, shmName: '/test-none', numGpuBlocksOverride: 64 })
  const d = build(t, { kv: 'agent', role: 'decode', agentUrl, shmName: '/test-none', numGpuBlocksOverride: 64 })
  t.equal((await p.app.inject({ url: '/health' })).statusCode, 503)
  t.match(await info(p), { agentAttached: false })
  const pr = await p.app.inject({ method: 'POST', url: '/v1/completions', payload: { ...body, max_tokens: 1, kv_transfer_params: { do_remote_decode: true } } })
  t.equal(pr.statusCode, 503)
  t.equal(pr.json().error.code, 'SIM_ERR_AGENT_NOT_READY')
  const params = { do_remote_prefill: true, remote_engine_id: 'p', remote_request_id: 'r', remote_host: '127.0.0.1', remote_port: 1, remote_block_ids: [[0, 1, 2]] }
  const dr = await d.app.inject({ method: 'POST', url: '/v1/completions', payload: { ...body, kv_transfer_params: params } })
  t.equal(dr.statusCode, 500)
  t.match(dr.json().error.message, /ECONNREFUSED/)
  t.match(await info(d), { usedBlocks: 0, taintedBlocks: 0 })
  await new Promise((r) => setTimeout(r, 400))
  t.equal(p.logs.filter((l) => l.msg === 'transfer agent unreachable; retrying').length, 1, 'logged once per outage')
})
