import t from 'tap'
import { ManualClock } from '../../common/clock.js'
import type { SimConfig } from '../../schemas/sim-config.js'
import { validateSimConfig } from '../../sim/src/config.js'
import { SIM_ERROR_CODES } from '../../sim/src/errors.js'
import { oracleText } from '../../sim/src/oracle.js'
import { renderChat } from '../../sim/src/chat-template.js'
import { tokenize } from '../../sim/src/tokenizer.js'
import { FakeKv } from './fake-kv.js'
import { build, MODEL, parseSse } from './build.js'

type Choice = { text?: string; delta?: { content?: string; role?: string }; finish_reason: string | null }

t.test('non-streamed completions and chat equal the oracle', async (t) => {
  const { app } = build(t)
  const r = await app.inject({ method: 'POST', url: '/v1/completions', headers: { 'x-request-id': 'req-1' }, payload: { model: MODEL, prompt: 'Say hi', max_tokens: 7 } })
  t.equal(r.statusCode, 200)
  const body = r.json()
  t.equal(body.id, 'cmpl-req-1')
  t.equal(body.object, 'text_completion')
  t.equal(body.choices[0].text, oracleText({ kind: 'completion', prompt: 'Say hi', maxTokens: 7 }))
  t.equal(body.choices[0].finish_reason, 'length')
  t.same(body.usage, { prompt_tokens: 2, completion_tokens: 7, total_tokens: 9 })
  t.equal(body.kv_transfer_params, null)

  const messages = [{ role: 'user', content: 'Hello there' }]
  const c = await app.inject({ method: 'POST', url: '/v1/chat/completions', payload: { model: MODEL, messages, max_tokens: 30, max_completion_tokens: 5 } })
  t.equal(c.statusCode, 200)
  const chat = c.json()
  t.match(chat.id, /^chatcmpl-[0-9a-f]{32}$/, 'a random uuid hex when no X-Request-Id')
  t.equal(chat.choices[0].message.role, 'assistant')
  t.equal(chat.choices[0].message.content, oracleText({ kind: 'chat', messages, maxTokens: 5 }))
  const d = await app.inject({ method: 'POST', url: '/v1/chat/completions', payload: { model: MODEL, messages } })
  t.equal(d.json().usage.completion_tokens, 16, 'defaultMaxTokens when absent')
})

t.test('streamed chat and completions equal the oracle', async (t) => {
  const { app } = build(t)
  const messages = [{ role: 'user', content: 'Stream me' }]
  const r = await app.inject({
    method: 'POST',
    url: '/v1/chat/completions',
    headers: { 'x-request-id': 'abc' },
    payload: { model: MODEL, messages, max_tokens: 6, stream: true, stream_options: { include_usage: true } },
  })
  t.equal(r.statusCode, 200)
  t.match(r.headers['content-type'], /text\/event-stream/)
  const { frames, done } = parseSse(r.body)
  t.ok(done)
  const choices = frames.map((f) => (f.choices as Choice[])[0])
  t.same(choices[0]?.delta, { role: 'assistant', content: '' }, 'first chunk carries the role')
  t.equal(choices.filter(Boolean).length, 1 + 6, 'role chunk + one chunk per token')
  t.equal(choices.map((c) => c?.delta?.content ?? '').join(''), oracleText({ kind: 'chat', messages, maxTokens: 6 }))
  t.equal(choices[6]?.finish_reason, 'length')
  const promptTokens = tokenize(renderChat(messages)).length
  t.same(frames.at(-1)?.usage, { prompt_tokens: promptTokens, completion_tokens: 6, total_tokens: promptTokens + 6 })
  t.ok(frames.every((f) => f.id === 'chatcmpl-abc' && f.object === 'chat.completion.chunk'))

  const c = await app.inject({ method: 'POST', url: '/v1/completions', payload: { model: MODEL, prompt: 'abc', max_tokens: 4, stream: true } })
  const parsed = parseSse(c.body)
  t.equal(parsed.frames.length, 4, 'no usage chunk unless asked')
  t.equal(parsed.frames.map((f) => (f.choices as Choice[])[0]?.text).join(''), oracleText({ kind: 'completion', prompt: 'abc', maxTokens: 4 }))
})

t.test('prefill leg answers with vLLM kv_transfer_params', async (t) => {
  const { app } = build(t, { role: 'prefill', engineId: 'p-engine', sideChannelHost: '10.0.0.5', sideChannelPort: 5601 })
  const messages = [{ role: 'user', content: 'A prompt long enough to need two blocks of sixteen tokens each, I hope so.' }]
  const r = await app.inject({
    method: 'POST',
    url: '/v1/chat/completions',
    headers: { 'x-request-id': 'rid-7' },
    payload: { model: MODEL, messages, max_tokens: 1, stream: false, kv_transfer_params: { do_remote_decode: true, do_remote_prefill: false, remote_engine_id: null, remote_block_ids: null, remote_host: null, remote_port: null } },
  })
  t.equal(r.statusCode, 200)
  const body = r.json()
  const kv = body.kv_transfer_params
  t.match(kv.remote_request_id, /^chatcmpl-rid-7-[0-9a-f]{8}$/)
  t.same(kv, {
    do_remote_decode: false,
    do_remote_prefill: true,
    remote_engine_id: 'p-engine',
    remote_block_ids: [[0, 1, 2].slice(0, Math.ceil(body.usage.prompt_tokens / 16))],
    remote_request_id: kv.remote_request_id,
    remote_host: '10.0.0.5',
    remote_port: 5601,
    tp_size: 1,
    dcp_size: 1,
    pp_size: 1,
    remote_num_tokens: body.usage.prompt_tokens,
    remote_blocks_expiry_time: null,
    transfer_mode: 'pull',
    remote_prefill_cached_tokens: 0,
  })
  t.equal(body.choices[0].message.content, oracleText({ kind: 'chat', messages, maxTokens: 1 }), 'P generates the first token')
  const info = (await app.inject({ url: '/sim/info' })).json()
  t.equal(info.usedBlocks, 0, '--kv none frees P blocks at once')
  // A prefill-only simulator still serves a plain request.
  const plain = await app.inject({ method: 'POST', url: '/v1/completions', payload: { model: MODEL, prompt: 'plain', max_tokens: 3 } })
  t.equal(plain.json().choices[0].text, oracleText({ kind: 'completion', prompt: 'plain', maxTokens: 3 }))
})

t.test('decode leg: P params, invalid params, mismatched prompt', async (t) => {
  const p = build(t, { role: 'prefill' })
  const d = build(t, { role: 'decode' })
  const body = { model: MODEL, prompt: 'The same prompt on both legs', max_tokens: 8 }
  const pr = await p.app.inject({ method: 'POST', url: '/v1/completions', payload: { ...body, max_tokens: 1, kv_transfer_params: { do_remote_decode: true } } })
  const params = pr.json().kv_transfer_params
  const dr = await d.app.inject({ method: 'POST', url: '/v1/completions', payload: { ...body, kv_transfer_params: params } })
  t.equal(dr.statusCode, 200)
  t.equal(dr.json().choices[0].text, oracleText({ kind: 'completion', prompt: body.prompt, maxTokens: 8 }))
  t.equal(dr.json().kv_transfer_params, null)
  t.match(d.logs.find((l) => l.msg === 'request served'), { mode: 'remote-decode' })

  const bad = await d.app.inject({ method: 'POST', url: '/v1/completions', payload: { ...body, kv_transfer_params: { ...params, remote_block_ids: [] } } })
  t.equal(bad.statusCode, 200, 'invalid params: served with local prefill, like vLLM')
  t.equal(bad.json().choices[0].text, oracleText({ kind: 'completion', prompt: body.prompt, maxTokens: 8 }))
  t.match(d.logs.find((l) => l.msg === 'Got invalid KVTransferParams'), { missing: 'remote_block_ids' })

  const mismatch = await d.app.inject({ method: 'POST', url: '/v1/completions', payload: { ...body, prompt: 'A different prompt', kv_transfer_params: params } })
  t.equal(mismatch.statusCode, 400)
  t.match(mismatch.json(), { error: { type: 'BadRequestError', code: 'SIM_ERR_NUM_TOKENS_MISMATCH', param: null } })

  // do_remote_decode sent to a decoder: served locally, no params (router misconfiguration).
  const wrong = await d.app.inject({ method: 'POST', url: '/v1/completions', payload: { ...body, kv_transfer_params: { do_remote_decode: true } } })
  t.equal(wrong.json().kv_transfer_params, null)
})

t.test('kvLoadFailureRate: a decode leg fails its KV load as a failed pull does; other legs are untouched', async (t) => {
  const p = build(t, { role: 'prefill' })
  const body = { model: MODEL, prompt: 'A prompt whose KV load will fail', max_tokens: 6 }
  const params = (await p.app.inject({ method: 'POST', url: '/v1/completions', payload: { ...body, max_tokens: 1, kv_transfer_params: { do_remote_decode: true } } })).json().kv_transfer_params
  const oracle = oracleText({ kind: 'completion', prompt: body.prompt, maxTokens: 6 })

  const fail = build(t, { role: 'decode', faults: { kvLoadFailureRate: 1 } })
  const whole = await fail.app.inject({ method: 'POST', url: '/v1/completions', payload: { ...body, kv_transfer_params: params } })
  t.equal(whole.statusCode, 500, 'policy fail, not streamed: 500')
  t.match(whole.json(), { error: { code: 'SIM_ERR_KV_LOAD_FAILED', message: /SIM_INJECTED/ } })
  const streamed = await fail.app.inject({ method: 'POST', url: '/v1/completions', payload: { ...body, stream: true, kv_transfer_params: params } })
  t.equal(streamed.statusCode, 200, 'streamed: 200 first, as vLLM')
  const sse = parseSse(streamed.body)
  t.match(sse.frames, [{ error: { code: 'SIM_ERR_KV_LOAD_FAILED' } }], 'then one error event')
  t.ok(sse.done, 'and [DONE]')
  const plain = await fail.app.inject({ method: 'POST', url: '/v1/completions', payload: body })
  t.equal(plain.json().choices[0].text, oracle, 'a request without params has no KV to load: served')
  t.match((await fail.app.inject({ url: '/sim/faults' })).json(), { kvLoadFailureRate: 1 })

  const recompute = build(t, { role: 'decode', kvLoadFailurePolicy: 'recompute', faults: { kvLoadFailureRate: 1 } })
  const again = await recompute.app.inject({ method: 'POST', url: '/v1/completions', payload: { ...body, kv_transfer_params: params } })
  t.equal(again.statusCode, 200, 'policy recompute: served')
  t.equal(again.json().choices[0].text, oracle, 'with the oracle text, prefilled by D itself')
  t.match(recompute.logs.find((l) => l.msg === 'request served'), { mode: 'local' })
})

t.test('a batch of prompts is served as vLLM serves it: each prompt’s choices in order, prompt tokens summed', async (t) => {
  const { app } = build(t)
  const post = async (payload: object) => (await app.inject({ method: 'POST', url: '/v1/completions', headers: { 'content-type': 'application/json' }, payload })).json()
  const one = await post({ model: MODEL, prompt: 'the first prompt', max_tokens: 3 })
  const two = await post({ model: MODEL, prompt: 'and a second one', max_tokens: 3 })
  const batch = await post({ model: MODEL, prompt: ['the first prompt', 'and a second one'], max_tokens: 3, n: 2 })
  t.same(
    batch.choices.map((c: { index: number; text: string }) => [c.index, c.text]),
    [
      [0, one.choices[0].text],
      [1, one.choices[0].text],
      [2, two.choices[0].text],
      [3, two.choices[0].text],
    ],
  )
  t.equal(batch.usage.prompt_tokens, one.usage.prompt_tokens + two.usage.prompt_tokens, 'each prompt counted once')
  t.equal(batch.usage.completion_tokens, 12)
})

t.test('bad requests get OpenAI error bodies', async (t) => {
  const { app } = build(t, { maxModelLen: 20 })
  const cases: [object | string, number, string][] = [
    [{ model: 'other', prompt: 'x' }, 404, 'SIM_ERR_MODEL_NOT_FOUND'],
    [{ model: MODEL }, 400, 'SIM_ERR_BAD_REQUEST'],
    [{ model: MODEL, prompt: 'x', max_tokens: 'many' }, 400, 'SIM_ERR_BAD_REQUEST'],
    [{ model: MODEL, prompt: 'a b c d e f g h i j k l m n o p q r s t u v' }, 400, 'SIM_ERR_PROMPT_TOO_LONG'],
    [{ model: MODEL, prompt: 'a', max_tokens: 20 }, 400, 'SIM_ERR_MAX_TOKENS_TOO_LARGE'],
    [{ model: MODEL, prompt: [] }, 400, 'SIM_ERR_BAD_REQUEST'],
    ['{not json', 400, 'FST_ERR_CTP_INVALID_JSON_BODY'],
  ]
  for (const [payload, status, code] of cases) {
    const r = await app.inject({ method: 'POST', url: '/v1/completions', headers: { 'content-type': 'application/json' }, payload })
    t.equal(r.statusCode, status, code)
    t.match(r.json(), { error: { message: String, type: String, param: null, code } })
  }
  const nf = await app.inject({ method: 'POST', url: '/v1/nothing', payload: {} })
  t.equal(nf.statusCode, 404)
  t.equal(nf.json().error.code, 'SIM_ERR_NOT_FOUND')
  const model404 = await app.inject({ method: 'POST', url: '/v1/chat/completions', payload: { model: 'x', messages: [{ role: 'user', content: 'a' }] } })
  t.equal(model404.json().error.message, 'The model `x` does not exist.')
  t.ok(SIM_ERROR_CODES.includes(model404.json().error.code))
})

t.test('health, models, metrics, request log', async (t) => {
  const { app } = build(t, { model: 'm-1' })
  const h = await app.inject({ url: '/health' })
  t.equal(h.statusCode, 200)
  t.equal(h.body, '')
  const models = (await app.inject({ url: '/v1/models' })).json()
  t.match(models, { object: 'list', data: [{ id: 'm-1', object: 'model' }] })
  await app.inject({ method: 'POST', url: '/v1/completions', headers: { 'x-request-id': 'seen' }, payload: { model: 'm-1', prompt: 'count me', max_tokens: 2 } })
  const m = (await app.inject({ url: '/metrics' })).body
  for (const name of [
    'vllm:num_requests_running',
    'vllm:num_requests_waiting',
    'vllm:kv_cache_usage_perc',
    'vllm:request_success_total',
    'vllm:prompt_tokens_total',
    'vllm:generation_tokens_total',
    'vllm:time_to_first_token_seconds',
    'vllm:nixl_num_kv_expired_reqs_total',
    'vllm:nixl_num_failed_transfers_total',
  ]) {
    t.match(m, `# TYPE ${name} `, name)
  }
  t.match(m, 'vllm:request_success_total{model_name="m-1",engine="0",finished_reason="length"} 1')
  t.match(m, 'vllm:generation_tokens_total{model_name="m-1",engine="0"} 2')
  t.match(m, 'vllm:num_requests_running{model_name="m-1",engine="0"} 0')
  const log = (await app.inject({ url: '/sim/requests' })).json().requests
  t.same(
    log.map((l: { path: string }) => l.path),
    ['/v1/models', '/v1/completions'],
    'health, metrics and /sim are not recorded',
  )
  t.match(log[1], { method: 'POST', path: '/v1/completions', headers: { 'x-request-id': 'seen' }, body: { prompt: 'count me' } })
  t.equal((await app.inject({ method: 'POST', url: '/sim/requests/clear' })).statusCode, 204)
  t.same((await app.inject({ url: '/sim/requests' })).json().requests, [])
})

t.test('faults at run time', async (t) => {
  const exits: number[] = []
  const { app } = build(t, {}, { exit: (code) => exits.push(code) })
  const req = { method: 'POST' as const, url: '/v1/completions', payload: { model: MODEL, prompt: 'x', max_tokens: 2 } }
  t.equal((await app.inject({ method: 'POST', url: '/sim/faults', payload: { nope: 1 } })).statusCode, 400, 'unknown fault rejected')
  t.equal((await app.inject({ method: 'POST', url: '/sim/faults', payload: { errorRate: 2 } })).statusCode, 400)

  await app.inject({ method: 'POST', url: '/sim/faults', payload: { errorRate: 1 } })
  const e = await app.inject(req)
  t.equal(e.statusCode, 500)
  t.match(e.json(), { error: { code: 'SIM_ERR_INJECTED', type: 'InternalServerError' } })

  await app.inject({ method: 'POST', url: '/sim/faults', payload: { errorRate: 0, garbageRate: 1 } })
  const g = await app.inject(req)
  t.equal(g.statusCode, 200)
  t.throws(() => JSON.parse(g.body))

  await app.inject({ method: 'POST', url: '/sim/faults', payload: { garbageRate: 0, stallRate: 1, stallMs: 40 } })
  const t0 = performance.now()
  const s = await app.inject(req)
  t.ok(performance.now() - t0 >= 35, 'stalled')
  t.equal(s.statusCode, 200, 'answers after the stall')

  await app.inject({ method: 'POST', url: '/sim/faults', payload: { stallRate: 0, unhealthy: true } })
  t.equal((await app.inject({ url: '/health' })).statusCode, 503)
  const faults = (await app.inject({ method: 'POST', url: '/sim/faults', payload: { unhealthy: false, crashAfter: 2 } })).json()
  t.match(faults, { unhealthy: false, crashAfter: 2, stallMs: 40 })
  t.equal((await app.inject(req)).statusCode, 200)
  await app.inject(req).catch(() => undefined)
  t.same(exits, [1], 'crashAfter exits on the Nth request')
  t.same((await app.inject({ url: '/sim/faults' })).json().crashAfter, 2)
})

t.test('disconnect fault and decode delays over a real socket', async (t) => {
  const { app } = build(t, { decodeDelayMs: 5 })
  const url = await app.listen({ host: '127.0.0.1', port: 0 })
  const post = (body: object): Promise<Response> =>
    fetch(`${url}/v1/completions`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify(body), signal: AbortSignal.timeout(5000) })

  const t0 = performance.now()
  const ok = await post({ model: MODEL, prompt: 'slow', max_tokens: 5, stream: true })
  const text = await ok.text()
  t.ok(performance.now() - t0 >= 18, 'four decode steps of 5 ms')
  t.equal(parseSse(text).frames.map((f) => (f.choices as Choice[])[0]?.text).join(''), oracleText({ kind: 'completion', prompt: 'slow', maxTokens: 5 }))

  await app.inject({ method: 'POST', url: '/sim/faults', payload: { disconnectRate: 1 } })
  const streamed = await post({ model: MODEL, prompt: 'cut', max_tokens: 5, stream: true })
  t.equal(streamed.status, 200)
  await t.rejects(streamed.text(), 'stream cut after the first chunk')
  const plain = await post({ model: MODEL, prompt: 'cut', max_tokens: 5 })
  t.equal(plain.status, 200)
  await t.rejects(plain.text(), 'body cut after the headers')
  await app.inject({ method: 'POST', url: '/sim/faults', payload: { disconnectRate: 0 } })
  const m = (await app.inject({ url: '/metrics' })).body
  t.match(m, 'vllm:num_requests_running{model_name="handoff/sim-1",engine="0"} 0', 'cut requests are not left running')
})

t.test('a client that aborts during a stall ends the request at once', async (t) => {
  const { app, logs } = build(t, { faults: { stallRate: 1, stallMs: 60_000 } } as Partial<SimConfig>)
  const url = await app.listen({ host: '127.0.0.1', port: 0 })
  const ac = new AbortController()
  const pending = fetch(`${url}/v1/completions`, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify({ model: MODEL, prompt: 'x' }),
    signal: ac.signal,
  }).catch((err: unknown) => err)
  const stalled = (): boolean => logs.some((l) => l.msg === 'injected stall')
  for (let i = 0; i < 100 && !stalled(); i++) await new Promise((r) => setTimeout(r, 20))
  t.ok(stalled(), 'the request is stalling')
  ac.abort()
  t.type(await pending, Error)
  // The handler ends as soon as the client is gone, and says so without an error.
  const gone = (): Record<string, unknown> | undefined => logs.find((l) => l.msg === 'client went away')
  for (let i = 0; i < 100 && !gone(); i++) await new Promise((r) => setTimeout(r, 20))
  t.equal(gone()?.level, 30, 'the handler finished within 2 s, logged at info, not after the 60 s stall')
  t.notOk(logs.some((l) => l.msg === 'request failed'), 'a client leaving is not an engine failure')
})

t.test('close ends stalls at once', async (t) => {
  const { app } = build(t, { faults: { stallRate: 1, stallMs: 60_000 } } as Partial<SimConfig>)
  const url = await app.listen({ host: '127.0.0.1', port: 0 })
  const pending = fetch(`${url}/v1/completions`, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify({ model: MODEL, prompt: 'x' }),
  })
  await new Promise((r) => setTimeout(r, 50))
  const t0 = performance.now()
  await app.close()
  t.ok(performance.now() - t0 < 2000, 'close does not wait for the stall')
  const res = await pending.catch((err: unknown) => err)
  if (res instanceof Response) t.equal(res.status, 503)
  else t.pass('connection closed')
})

t.test('--kv agent: the KvTransport seam, leases and a read after expiry', async (t) => {
  t.throws(() => validateSimConfig({ kv: 'agent' }), { code: 'SIM_ERR_INVALID_CONFIG', message: /agentUrl is required/ })

  // In-process stand-ins for the transfer agents: a pull copies P's block bytes into D's blocks.
  const clock = new ManualClock()
  const kv = new FakeKv({ clock, leaseMs: 5000 })
  const agent = { kv: 'agent', agentUrl: 'http://127.0.0.1:9', numGpuBlocksOverride: 64 }
  const p = build(t, { ...agent, role: 'prefill', engineId: 'p0' }, { kvTransport: kv.transport(), clock })
  const d = build(t, { ...agent, role: 'decode' }, { kvTransport: kv.transport() })
  const body = { model: MODEL, prompt: 'a prompt whose KV really moves between the two engines', max_tokens: 6 }
  const want = oracleText({ kind: 'completion', prompt: body.prompt, maxTokens: 6 })
  const info = async (): Promise<{ leases: number; usedBlocks: number }> => (await p.app.inject({ url: '/sim/info' })).json()
  const prefill = async (prompt: string): Promise<Record<string, unknown>> =>
    (await p.app.inject({ method: 'POST', url: '/v1/completions', payload: { ...body, prompt, max_tokens: 1, kv_transfer_params: { do_remote_decode: true } } })).json().kv_transfer_params

  const params = await prefill(body.prompt)
  t.equal(params.remote_blocks_expiry_time, (clock.monotonic() + 5000) / 1000, "the agent's deadline, exported verbatim")
  t.match(params, { remote_host: '127.0.0.1', remote_port: 7600 }, "the agent's address, not --side-channel-*")
  t.match(await info(), { leases: 1, usedBlocks: 1 })
  const dr = await d.app.inject({ method: 'POST', url: '/v1/completions', payload: { ...body, kv_transfer_params: params } })
  t.equal(dr.json().choices[0].text, want, 'a timely read gives the oracle text')
  t.match(await info(), { leases: 0, usedBlocks: 0 }, 'read done: the blocks are free at once')
  t.match((await d.app.inject({ url: '/sim/requests' })).json().requests[0], { kvLoad: 'ok' })

  // Unread, the lease expires; another request reuses the blocks (LIFO); a late read is wrong.
  const unread = await prefill(body.prompt)
  clock.advance(6000)
  t.match(await info(), { leases: 0, usedBlocks: 0 })
  t.match((await p.app.inject({ url: '/metrics' })).body, 'vllm:nixl_num_kv_expired_reqs_total{model_name="handoff/sim-1",engine="0"} 1')
  const other = await prefill('someone else entirely, with different words')
  t.same(other.remote_block_ids, unread.remote_block_ids, 'same blocks reused')
  const late = await d.app.inject({ method: 'POST', url: '/v1/completions', payload: { ...body, kv_transfer_params: unread } })
  t.equal(late.statusCode, 200, 'silent, as in vLLM')
  t.not(late.json().choices[0].text, want, 'stale bytes give wrong text')
})

t.test('--kv agent: a failed pull fails the request or recomputes, by kv_load_failure_policy', async (t) => {
  const kv = new FakeKv({ clock: new ManualClock() })
  const agent = { kv: 'agent', agentUrl: 'http://127.0.0.1:9', numGpuBlocksOverride: 64 }
  const p = build(t, { ...agent, role: 'prefill' }, { kvTransport: kv.transport() })
  const fail = build(t, { ...agent, role: 'decode' }, { kvTransport: kv.transport() })
  const recompute = build(t, { ...agent, role: 'decode', kvLoadFailurePolicy: 'recompute', prefillDelayMs: 0 }, { kvTransport: kv.transport() })
  const body = { model: MODEL, prompt: 'the pull of this prompt fails', max_tokens: 4 }
  const want = oracleText({ kind: 'completion', prompt: body.prompt, maxTokens: 4 })
  const params = (await p.app.inject({ method: 'POST', url: '/v1/completions', payload: { ...body, max_tokens: 1, kv_transfer_params: { do_remote_decode: true } } })).json().kv_transfer_params
  kv.failPulls = { agentCode: 'XFA_ERR_KV_EXPIRED', agentStatus: 410, invalidBlockIds: [0], tainted: false, sent: true }

  const f = await fail.app.inject({ method: 'POST', url: '/v1/completions', payload: { ...body, kv_transfer_params: params } })
  t.equal(f.statusCode, 500)
  t.match(f.json().error, { code: 'SIM_ERR_KV_LOAD_FAILED', message: /XFA_ERR_KV_EXPIRED/ })
  t.match((await fail.app.inject({ url: '/metrics' })).body, 'vllm:nixl_num_failed_transfers_total{model_name="handoff/sim-1",engine="0"} 1')
  t.match((await fail.app.inject({ url: '/sim/requests' })).json().requests[0], { kvLoad: 'failed', kvLoadError: 'XFA_ERR_KV_EXPIRED' })

  // A stream has sent its status before the engine runs (vLLM): an error event, then [DONE].
  const s = await fail.app.inject({ method: 'POST', url: '/v1/completions', payload: { ...body, stream: true, kv_transfer_params: params } })
  t.equal(s.statusCode, 200)
  const sse = parseSse(s.body)
  t.ok(sse.done)
  t.match(sse.frames, [{ error: { code: 'SIM_ERR_KV_LOAD_FAILED', message: /XFA_ERR_KV_EXPIRED/ } }])
  t.equal(sse.frames.length, 1)

  const r = await recompute.app.inject({ method: 'POST', url: '/v1/completions', payload: { ...body, kv_transfer_params: params } })
  t.equal(r.statusCode, 200)
  t.equal(r.json().choices[0].text, want, 'recomputed locally: the oracle text')
  t.match((await recompute.app.inject({ url: '/sim/requests' })).json().requests[0], { kvLoad: 'recomputed', kvLoadError: 'XFA_ERR_KV_EXPIRED' })
  t.match((await recompute.app.inject({ url: '/metrics' })).body, 'handoff_sim_kv_recomputed_requests_total{model_name="handoff/sim-1",engine="0"} 1')
  t.match((await recompute.app.inject({ url: '/sim/info' })).json(), { usedBlocks: 0 })

  // A P that exported too few blocks for the prompt: nothing to pull the rest from.
  kv.failPulls = undefined
  const short = await fail.app.inject({ method: 'POST', url: '/v1/completions', payload: { ...body, prompt: `${body.prompt} ${'and much more '.repeat(20)}`, kv_transfer_params: { ...params, remote_num_tokens: undefined } } })
  t.equal(short.statusCode, 500)
  t.match(short.json().error.message, /SIM_REMOTE_BLOCKS_SHORT/)
})
