import t, { type Test } from 'tap'
import { spawnService, type SpawnedService } from '../../common/spawn.js'
import { oracleText } from '../../sim/src/oracle.js'
import { needNixl, probeNixl } from '../native/helpers.js'
import { eventually } from './build.js'

/*
 * `handoff sim --kv agent` end to end with real processes (needs `npm run build` and NIXL):
 * two transfer agents, a prefill simulator and a decode simulator, each simulator attached to
 * its agent over the loopback API; the legs are sent by hand, as a router would.
 */

const skip = needNixl(t, await probeNixl())
const MODEL = 'handoff/sim-1'

async function start(t: Test, args: string[]): Promise<SpawnedService> {
  const svc = await spawnService({ args, readyTimeoutMs: 30_000 })
  t.teardown(() => svc.stop(3000))
  return svc
}

async function call(base: string, path: string, body?: unknown): Promise<{ status: number; json: Record<string, unknown> }> {
  const r = await fetch(base.replace(/\/$/, '') + path, {
    method: body === undefined ? 'GET' : 'POST',
    headers: body === undefined ? {} : { 'content-type': 'application/json' },
    body: body === undefined ? undefined : JSON.stringify(body),
    signal: AbortSignal.timeout(20_000),
  })
  return { status: r.status, json: (await r.json()) as Record<string, unknown> }
}

t.test('P and D simulators move KV through their agents', { skip }, async (t) => {
  const agent = ['agent', '--port', '0', '--lease-seconds', '10', '--log-level', 'warn']
  const [agentP, agentD] = await Promise.all([start(t, agent), start(t, agent)])
  const sim = (role: string, agentUrl: string) => ['sim', '--role', role, '--port', '0', '--kv', 'agent', '--agent-url', agentUrl, '--lease-seconds', '10', '--log-level', 'warn']
  const [p, d] = await Promise.all([start(t, sim('prefill', agentP.url)), start(t, sim('decode', agentD.url))])
  t.equal((await fetch(`${p.url}/health`)).status, 200, 'ready means attached')

  const body = { model: MODEL, prompt: 'KV bytes that really cross from one process to another', max_tokens: 8 }
  const pr = await call(p.url, '/v1/completions', { ...body, max_tokens: 1, kv_transfer_params: { do_remote_decode: true } })
  t.equal(pr.status, 200)
  const params = pr.json.kv_transfer_params as Record<string, unknown>
  t.equal(params.remote_port, Number(new URL(agentP.url).port), "P exports its agent's address")
  t.type(params.remote_blocks_expiry_time, 'number')
  const pInfo = await call(p.url, '/sim/info')
  t.match(pInfo.json, { leases: 1, agentAttached: true })
  t.ok((pInfo.json.usedBlocks as number) > 0)

  const dr = await call(d.url, '/v1/completions', { ...body, kv_transfer_params: params })
  t.equal(dr.status, 200, 'decode leg')
  const choices = dr.json.choices as { text: string }[]
  t.equal(choices[0]?.text, oracleText({ kind: 'completion', prompt: body.prompt, maxTokens: 8 }), 'D generates the oracle text from the pulled bytes')
  const log = (await call(d.url, '/sim/requests')).json.requests as Record<string, unknown>[]
  t.match(log.at(-1), { kvLoad: 'ok' })
  await eventually(t, "P's blocks are freed after the read", async () => (await call(p.url, '/sim/info')).json.usedBlocks === 0, 10_000)
  t.match((await call(d.url, '/sim/info')).json, { usedBlocks: 0, taintedBlocks: 0 })

  // A pull that fails (the engine id does not match the agent at that address): a 500 that
  // names the agent's code, and D's blocks come back once the agent reports the pull quiescent.
  const bad = await call(d.url, '/v1/completions', { ...body, kv_transfer_params: { ...params, remote_engine_id: 'not-that-engine' } })
  t.equal(bad.status, 500)
  t.match(bad.json.error, { code: 'SIM_ERR_KV_LOAD_FAILED', message: /XFA_ERR_/ })
  await eventually(t, "the failed pull's blocks are freed", async () => (await call(d.url, '/sim/info')).json.usedBlocks === 0, 10_000)
  const last = ((await call(d.url, '/sim/requests')).json.requests as Record<string, unknown>[]).at(-1)
  t.match(last, { kvLoad: 'failed', kvLoadError: /^XFA_ERR_/ })
})
