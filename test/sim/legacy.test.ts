import t from 'tap'
import { ManualClock } from '../../common/clock.js'
import { parseSimArgs } from '../../sim/src/config.js'
import { parseRemoteKv } from '../../sim/src/kv-source.js'
import { oracleText } from '../../sim/src/oracle.js'
import { build, MODEL } from './build.js'
import { FakeKv } from './fake-kv.js'

const body = { model: MODEL, prompt: 'an old vLLM pair that shares one request id', max_tokens: 5 }
const want = oracleText({ kind: 'completion', prompt: body.prompt, maxTokens: 5 })

t.test('--vllm-compat legacy: P params without remote_request_id, flat block ids; D reads under its own id', async (t) => {
  const kv = new FakeKv({ clock: new ManualClock() })
  const agent = { kv: 'agent', agentUrl: 'http://127.0.0.1:9', numGpuBlocksOverride: 64, vllmCompat: 'legacy' }
  const p = build(t, { ...agent, role: 'prefill', engineId: 'old-p' }, { kvTransport: kv.transport() })
  const d = build(t, { ...agent, role: 'decode' }, { kvTransport: kv.transport() })

  const pr = await p.app.inject({
    method: 'POST',
    url: '/v1/completions',
    headers: { 'x-request-id': 'same-1' },
    payload: { ...body, max_tokens: 1, kv_transfer_params: { do_remote_decode: true } },
  })
  t.equal(pr.statusCode, 200)
  const params = pr.json().kv_transfer_params
  t.same(Object.keys(params).sort(), [
    'do_remote_decode', 'do_remote_prefill', 'remote_block_ids', 'remote_blocks_expiry_time', 'remote_engine_id', 'remote_host', 'remote_port', 'tp_size',
  ], 'no remote_request_id (agent mode keeps the lease deadline)')
  t.ok(params.remote_block_ids.every((b: unknown) => Number.isInteger(b)), 'a flat list of block ids')
  t.match(p.logs.find((l) => l.msg === 'request served'), { internalId: 'cmpl-same-1' }, 'no random suffix')
  t.equal((await p.app.inject({ url: '/sim/info' })).json().leases, 1)

  const dr = await d.app.inject({ method: 'POST', url: '/v1/completions', headers: { 'x-request-id': 'same-1' }, payload: { ...body, kv_transfer_params: params } })
  t.equal(dr.statusCode, 200)
  t.equal(dr.json().choices[0].text, want)
  t.equal(kv.pulls[0]?.remote.remoteRequestId, 'cmpl-same-1', "D looks P's lease up by its own request id")
  t.match(d.logs.find((l) => l.msg === 'request served'), { mode: 'remote-decode', internalId: 'cmpl-same-1' })
})

t.test('legacy params: the exact old shape in --kv none; a current D refuses them like vLLM', async (t) => {
  const p = build(t, { role: 'prefill', vllmCompat: 'legacy', engineId: 'old-p', sideChannelPort: 5601 })
  const pr = (await p.app.inject({ method: 'POST', url: '/v1/chat/completions', headers: { 'x-request-id': 'x9' }, payload: { model: MODEL, messages: [{ role: 'user', content: 'hi' }], max_tokens: 1, kv_transfer_params: { do_remote_decode: true } } })).json()
  t.equal(pr.id, 'chatcmpl-x9')
  t.same(pr.kv_transfer_params, {
    do_remote_prefill: true,
    do_remote_decode: false,
    remote_block_ids: Array.from({ length: Math.ceil(pr.usage.prompt_tokens / 16) }, (_, i) => i),
    remote_engine_id: 'old-p',
    remote_host: '127.0.0.1',
    remote_port: 5601,
    tp_size: 1,
  })

  const current = build(t, { role: 'decode' })
  const legacyParams = { do_remote_prefill: true, do_remote_decode: false, remote_block_ids: [0, 1], remote_engine_id: 'old-p', remote_host: 'h', remote_port: 1, tp_size: 1 }
  const r = await current.app.inject({ method: 'POST', url: '/v1/completions', payload: { ...body, kv_transfer_params: legacyParams } })
  t.equal(r.json().choices[0].text, want, 'prefilled locally')
  t.match(current.logs.find((l) => l.msg === 'Got invalid KVTransferParams'), { missing: 'remote_request_id' })

  const old = build(t, { role: 'decode', vllmCompat: 'legacy' })
  const o = await old.app.inject({ method: 'POST', url: '/v1/completions', payload: { ...body, kv_transfer_params: legacyParams } })
  t.equal(o.json().choices[0].text, want)
  t.match(old.logs.find((l) => l.msg === 'request served'), { mode: 'remote-decode' })
})

t.test('flag and parser', async (t) => {
  const c = parseSimArgs(['--vllm-compat', 'legacy'])
  t.match(c, { vllmCompat: 'legacy' })
  t.match(parseSimArgs([]), { vllmCompat: 'current' })
  t.throws(() => parseSimArgs(['--vllm-compat', 'ancient']), { code: 'SIM_ERR_INVALID_CONFIG', message: /--vllm-compat/ })
  const flat = { remote_block_ids: [3, 4], remote_engine_id: 'e', remote_host: 'h', remote_port: 1 }
  t.same(parseRemoteKv(flat), { missing: 'remote_request_id' })
  t.match(parseRemoteKv(flat, { legacyRequestId: 'cmpl-mine' }), { remoteRequestId: 'cmpl-mine', blockIds: [3, 4], remoteBlockIds: [3, 4] })
  t.match(parseRemoteKv({ ...flat, remote_request_id: 'theirs' }, { legacyRequestId: 'cmpl-mine' }), { remoteRequestId: 'theirs' })
  t.match(parseRemoteKv({ ...flat, remote_block_ids: [[5, 6]], remote_request_id: 'r' }), { blockIds: [5, 6] })
  t.same(parseRemoteKv({ ...flat, remote_block_ids: ['a'] }), { missing: 'remote_block_ids' })
})
