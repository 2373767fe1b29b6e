import t from 'tap'
import { oracleForBody } from '../../sim/src/oracle.js'
import { get, post, simRequests, startRouter, startSim, streamedText, sseEvents } from '../helpers/cluster.js'

// Real simulator processes behind a real router (in-process, on a loopback port).
const p = await startSim(t, ['--role', 'prefill'])
const d = await startSim(t, ['--role', 'decode'])
const { url, app } = await startRouter(t, [
  { id: 'p0', role: 'prefill', url: p.url },
  { id: 'd0', role: 'decode', url: d.url },
])

const MODEL = 'handoff/sim-1'
const chat = { model: MODEL, messages: [{ role: 'user', content: 'Tell me about disaggregated serving.' }], max_tokens: 12 }
const completion = { model: MODEL, prompt: 'The quick brown fox jumps over the lazy dog', max_tokens: 9 }

async function clear(): Promise<void> {
  await post(`${p.url}/sim/requests/clear`, {})
  await post(`${d.url}/sim/requests/clear`, {})
}

t.test('non-streamed chat and text completions return the oracle text', async (t) => {
  const c = await post(`${url}/v1/chat/completions`, chat)
  t.equal(c.status, 200)
  const body = c.json<{ choices: { message: { content: string } }[]; usage: { completion_tokens: number } }>()
  t.equal(body.choices[0]?.message.content, oracleForBody('/v1/chat/completions', chat))
  t.equal(body.usage.completion_tokens, 12)
  const x = await post(`${url}/v1/completions`, completion)
  t.equal(x.status, 200)
  t.equal(x.json<{ choices: { text: string }[] }>().choices[0]?.text, oracleForBody('/v1/completions', completion))
})

t.test('streamed answers are relayed as SSE and concatenate to the oracle text', async (t) => {
  for (const [path, body] of [
    ['/v1/chat/completions', chat],
    ['/v1/completions', completion],
  ] as const) {
    const res = await post(`${url}${path}`, { ...body, stream: true, stream_options: { include_usage: true } })
    t.equal(res.status, 200)
    t.match(String(res.headers['content-type']), /^text\/event-stream/)
    const events = sseEvents(res.text)
    t.equal(events.at(-1), '[DONE]')
    t.equal(streamedText(res.text), oracleForBody(path, body), path)
    t.ok(events.some((e) => e !== '[DONE]' && e.usage), 'usage chunk kept: stream_options reached D')
  }
})

t.test('the legs carry exactly what the protocol says, with one fresh engine request id', async (t) => {
  await clear()
  const res = await post(`${url}/v1/chat/completions`, { ...chat, stream: true, stream_options: { include_usage: true }, min_tokens: 2, temperature: 0 }, { 'x-request-id': 'req-legs-1' })
  t.equal(res.status, 200)
  t.equal(res.headers['x-request-id'], 'req-legs-1')
  const [pr] = (await simRequests(p)).filter((r) => r.path === '/v1/chat/completions')
  const [dr] = (await simRequests(d)).filter((r) => r.path === '/v1/chat/completions')
  t.ok(pr && dr, 'each leg reached its engine once')
  // Issue 6 item 5: the client's id stays with the client; the engines get one fresh id per handoff.
  const engineId = pr?.headers['x-request-id']
  t.match(engineId, /^hnd-[0-9a-f]{24}$/)
  t.equal(dr?.headers['x-request-id'], engineId, 'the same engine request id on both legs')
  t.match(pr?.body, { stream: false, max_tokens: 1, temperature: 0, ignore_eos: true, n: 1, kv_transfer_params: { do_remote_decode: true } })
  t.notOk(pr && 'stream_options' in pr.body, 'stream_options removed on P')
  t.notOk(pr && 'min_tokens' in pr.body, 'min_tokens removed on P')
  t.match(dr?.body, { stream: true, max_tokens: 12, min_tokens: 2, stream_options: { include_usage: true } })
  // D got P's params verbatim: compare with what P answered by replaying the P leg.
  const params = dr?.body.kv_transfer_params as Record<string, unknown>
  t.match(params, { do_remote_prefill: true, do_remote_decode: false, transfer_mode: 'pull', tp_size: 1 })
  t.type(params.remote_engine_id, 'string')
  t.match(String(params.remote_request_id), new RegExp(`^chatcmpl-${engineId}-`))
})

t.test('bad input gets a 4xx OpenAI error and nothing is forwarded', async (t) => {
  await clear()
  const cases: [string, string | object, number, string][] = [
    ['/v1/chat/completions', '{"model": "x", "messages": [', 400, 'RTR_ERR_INVALID_JSON'],
    ['/v1/chat/completions', { model: MODEL }, 400, 'RTR_ERR_INVALID_REQUEST'],
    ['/v1/chat/completions', { model: MODEL, messages: [] }, 400, 'RTR_ERR_INVALID_REQUEST'],
    ['/v1/chat/completions', { model: MODEL, messages: 'hi' }, 400, 'RTR_ERR_INVALID_REQUEST'],
    ['/v1/completions', { model: MODEL, prompt: 'x', max_tokens: '5' }, 400, 'RTR_ERR_INVALID_REQUEST'],
    ['/v1/completions', { model: MODEL }, 400, 'RTR_ERR_INVALID_REQUEST'],
    ['/v1/completions', { model: 'no-such-model', prompt: 'x' }, 404, 'RTR_ERR_MODEL_NOT_FOUND'],
    ['/v1/nope', {}, 404, 'RTR_ERR_ROUTE_NOT_FOUND'],
  ]
  for (const [path, body, status, code] of cases) {
    const res = await post(`${url}${path}`, body)
    t.equal(res.status, status, `${code} status`)
    const err = res.json<{ error: { code: string; type: string; message: string; param: null } }>().error
    t.equal(err.code, code)
    t.type(err.message, 'string')
    t.ok(err.type.length > 0)
  }
  const big = await post(`${url}/v1/completions`, { model: MODEL, prompt: 'x'.repeat(17 * 1024 * 1024) })
  t.equal(big.status, 413)
  t.equal(big.json<{ error: { code: string } }>().error.code, 'RTR_ERR_BODY_TOO_LARGE')
  const media = await post(`${url}/v1/completions`, 'prompt=x', { 'content-type': 'application/x-www-form-urlencoded' })
  t.equal(media.status, 415)
  t.equal(media.json<{ error: { code: string } }>().error.code, 'RTR_ERR_UNSUPPORTED_MEDIA_TYPE')
  t.match(media.json<{ error: { message: string } }>().error.message, /"application\/x-www-form-urlencoded" is not supported/)
  t.same(await simRequests(p), [], 'P saw nothing')
  t.same(await simRequests(d), [], 'D saw nothing')
  // The router is unharmed.
  t.equal((await post(`${url}/v1/completions`, completion)).status, 200)
})

t.test("an engine's own 4xx is relayed as it is", async (t) => {
  // The simulator rejects prompts over its max model length with a vLLM-style 400.
  const res = await post(`${url}/v1/completions`, { ...completion, prompt: 'word '.repeat(140000) })
  t.equal(res.status, 400)
  t.ok(res.json<{ error: { message: string } }>().error.message.length > 0)
})

t.test('models, health, readiness and metrics', async (t) => {
  const models = await get(`${url}/v1/models`)
  t.same(models.json<{ data: { id: string }[] }>().data.map((m) => m.id), [MODEL])
  t.equal((await get(`${url}/health`)).status, 200)
  const ready = await get(`${url}/ready`)
  t.equal(ready.status, 200)
  t.match(ready.json(), { ready: true, instances: [{ id: 'p0', healthy: true }, { id: 'd0', healthy: true }] })
  const metrics = await get(`${url}/metrics`)
  t.match(metrics.text, /handoff_router_requests_total\{mode="pd",outcome="ok"\} \d+/)
  t.match(metrics.text, /handoff_router_handoff_gap_seconds_count \d+/)
  t.match(metrics.text, /handoff_router_instance_up\{instance="d0",role="decode"\} 1/)
  t.equal(app.topology.snapshot().instances.find((i) => i.id === 'p0')?.engineId !== undefined, true, 'engine_id learned from P answers')
})
