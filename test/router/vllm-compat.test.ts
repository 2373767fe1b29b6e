import t from 'tap'
import { get, post, simRequests, startRouter, startSim, type SimRequestRecord, type Teardown } from '../helpers/cluster.js'

// Issue 6 items 3, 5, 6 and 7: the prefill leg against a simulator that behaves like vLLM
// where the first router got it wrong. Every case runs real simulator processes.
const MODEL = 'handoff/sim-1'

type Record = SimRequestRecord & { xRequestId?: string | null; finishReason?: string; kvTransferParams?: { [k: string]: unknown } | null }

const completions = async (sim: { url: string }): Promise<Record[]> =>
  ((await simRequests(sim as never)) as Record[]).filter((r) => r.path.startsWith('/v1/') && r.path.endsWith('completions'))

async function pair(t: Teardown, pArgs: string[], dArgs: string[] = [], routerOverrides: object = {}) {
  const p = await startSim(t, ['--role', 'prefill', ...pArgs])
  const d = await startSim(t, ['--role', 'decode', ...dArgs])
  const router = await startRouter(
    t,
    [
      { id: 'p0', role: 'prefill', url: p.url },
      { id: 'd0', role: 'decode', url: d.url },
    ],
    { probe: false, ...routerOverrides },
  )
  return { p, d, url: router.url }
}

function readKv(r: Record | undefined): boolean {
  return (r?.body.kv_transfer_params as { do_remote_prefill?: boolean } | undefined)?.do_remote_prefill === true
}

t.test('item 3: P samples EOS as its one token: the leg still finishes by length and D reads the KV', async (t) => {
  const { p, d, url } = await pair(t, ['--seed', '51', '--eos-after-tokens', '1'], ['--seed', '52'])
  const res = await post(`${url}/v1/completions`, { model: MODEL, prompt: 'an eos on the first token', max_tokens: 5 })
  t.equal(res.status, 200)
  const [pr] = await completions(p)
  const [dr] = await completions(d)
  t.equal(pr?.finishReason, 'length', 'P finished by length (ignore_eos)')
  t.ok(pr?.kvTransferParams, 'P answered with kv_transfer_params')
  t.ok(readKv(dr), 'D got them and read the KV instead of prefilling again')
})

t.test("item 3: a client's stop and stop_token_ids do not stop the prefill leg, and still apply on D", async (t) => {
  const { p, d, url } = await pair(t, ['--seed', '53'], ['--seed', '54'])
  // Every word id of the simulator's vocabulary: any token stops, so P would finish by stop.
  const everyToken = Array.from({ length: 64 }, (_, i) => i)
  const res = await post(`${url}/v1/completions`, { model: MODEL, prompt: 'stop at once', max_tokens: 5, stop_token_ids: everyToken, min_tokens: 0 })
  t.equal(res.status, 200)
  const [pr] = await completions(p)
  const [dr] = await completions(d)
  t.equal(pr?.finishReason, 'length')
  t.ok(readKv(dr), 'D read the KV')
  t.same(dr?.body.stop_token_ids, everyToken, "D got the client's stop criteria back")
  t.equal(res.json<{ choices: { finish_reason: string }[] }>().choices[0]?.finish_reason, 'stop', 'and applied them')
})

t.test('item 5: two requests with the same client X-Request-Id never collide inside an engine', async (t) => {
  const { p, d, url } = await pair(t, ['--seed', '55'], ['--seed', '56', '--decode-delay-ms', '30'])
  const body = { model: MODEL, prompt: 'same id twice', max_tokens: 6 }
  const [a, b] = await Promise.all([post(`${url}/v1/completions`, body, { 'x-request-id': 'client-42' }), post(`${url}/v1/completions`, body, { 'x-request-id': 'client-42' })])
  t.equal(a.status, 200, a.text)
  t.equal(b.status, 200, b.text)
  t.equal(a.headers['x-request-id'], 'client-42', "the client's id comes back to the client")
  const ids = [...(await completions(p)), ...(await completions(d))].map((r) => r.xRequestId)
  t.notOk(ids.includes('client-42'), 'no engine saw the client id')
  t.equal(new Set(ids).size, 2, 'one engine request id per handoff, shared by its two legs')
})

t.test('item 6: vLLM before remote_request_id: the params are accepted and D reads the KV', async (t) => {
  const { p, d, url } = await pair(t, ['--seed', '57', '--vllm-compat', 'legacy'], ['--seed', '58', '--vllm-compat', 'legacy'])
  const res = await post(`${url}/v1/completions`, { model: MODEL, prompt: 'an older vllm', max_tokens: 4 })
  t.equal(res.status, 200)
  const [pr] = await completions(p)
  const [dr] = await completions(d)
  t.ok(pr?.kvTransferParams && !('remote_request_id' in pr.kvTransferParams), 'P sent the old shape')
  t.ok(readKv(dr), 'D got the params and read the KV')
  t.match((await get(`${url}/metrics`)).text, /^handoff_router_prefill_without_params_total 0$/m, 'nothing re-prefilled')
})

t.test('item 7: engines started with --api-key: probes and model discovery send the key', async (t) => {
  const key = 'engine-secret-123'
  const p = await startSim(t, ['--role', 'prefill', '--seed', '59', '--api-key', key])
  const d = await startSim(t, ['--role', 'decode', '--seed', '60', '--api-key', key])
  t.equal((await get(`${d.url}/v1/models`)).status, 401, 'the engine wants the key')
  const { url } = await startRouter(
    t,
    [
      { id: 'p0', role: 'prefill', url: p.url },
      { id: 'd0', role: 'decode', url: d.url },
    ],
    { upstreamApiKey: key },
  )
  const models = (await get(`${url}/v1/models`)).json<{ data: { id: string }[] }>().data.map((m) => m.id)
  t.same(models, [MODEL], 'models discovered through the key')
  const res = await post(`${url}/v1/completions`, { model: MODEL, prompt: 'with a key', max_tokens: 3 })
  t.equal(res.status, 200)
  t.equal((await post(`${url}/v1/completions`, { model: 'other', prompt: 'x' })).status, 404, 'an unknown model is refused now that models are known')
})

t.test('issue 19: a request D would refuse is refused before the prefill leg, with vLLM’s message', async (t) => {
  const { p, d, url } = await pair(t, [])
  const cases: [string, { [k: string]: unknown }, RegExp][] = [
    ['/v1/completions', { prompt: 'opts', stream_options: { include_usage: true } }, /Stream options can only be defined when `stream=True`/],
    ['/v1/chat/completions', { messages: [{ role: 'user', content: 'opts' }], stream_options: { include_usage: true }, stream: false }, /Stream options/],
    ['/v1/completions', { prompt: 'plp', prompt_logprobs: 1, stream: true }, /`prompt_logprobs` are not available when `stream=True`/],
    ['/v1/completions', { prompt: 'neg', logprobs: -2 }, /`logprobs` must be a positive value or -1/],
    ['/v1/chat/completions', { messages: [{ role: 'user', content: 'tlp' }], top_logprobs: 'two' }, /`top_logprobs` must be an integer/],
  ]
  for (const [path, body, message] of cases) {
    const routed = await post(`${url}${path}`, { model: MODEL, max_tokens: 2, ...body })
    t.equal(routed.status, 400, `${path} ${JSON.stringify(body)}: 400`)
    t.match(routed.json(), { error: { code: 'RTR_ERR_INVALID_REQUEST', message } })
    const direct = await post(`${d.url}${path}`, { model: MODEL, max_tokens: 2, ...body })
    t.equal(direct.status, 400, 'the simulator refuses it as vLLM does')
    t.match(direct.text, message)
  }
  t.same(await completions(p), [], 'P never prefilled any of them')
  const allowed = await post(`${url}/v1/completions`, { model: MODEL, prompt: 'fine', max_tokens: 2, stream: true, stream_options: { include_usage: true }, prompt_logprobs: 0 })
  t.equal(allowed.status, 200, 'stream_options with stream, and prompt_logprobs 0 streamed, pass')
})

t.test('issue 19: trace context and vLLM’s routing headers reach both legs; the client’s request id does not', async (t) => {
  const { p, d, url } = await pair(t, [])
  const sent = {
    traceparent: '00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01',
    tracestate: 'handoff=t61rcWkgMzE',
    'x-session-id': 'session-7',
    'x-vllm-priority': '3',
    'x-data-parallel-rank': '1',
    'x-request-id': 'client-id-9',
  }
  t.equal((await post(`${url}/v1/completions`, { model: MODEL, prompt: 'traced', max_tokens: 2 }, sent)).status, 200)
  for (const [leg, sim] of [['P', p], ['D', d]] as const) {
    const [r] = await completions(sim)
    for (const h of ['traceparent', 'tracestate', 'x-session-id', 'x-vllm-priority'] as const) t.equal(r?.headers[h], sent[h], `${leg} got ${h}`)
    t.notOk(r?.headers['x-data-parallel-rank'], `${leg} did not get the client's DP rank (P and D ranks differ)`)
    t.not(r?.headers['x-request-id'], 'client-id-9', `${leg} got the handoff's own request id`)
  }
})

t.test('issue 19: /v1/models passes on the engines’ cards (max_model_len, root, parent)', async (t) => {
  const { p, url } = await pair(t, ['--max-model-len', '3000'], ['--max-model-len', '3000'], { probe: true })
  const engine = (await get(`${p.url}/v1/models`)).json<{ data: { [k: string]: unknown }[] }>().data[0]
  const routed = (await get(`${url}/v1/models`)).json<{ data: { [k: string]: unknown }[] }>().data
  t.equal(routed.length, 1)
  t.match(routed[0], { id: MODEL, object: 'model', max_model_len: 3000, root: engine?.root, parent: engine?.parent ?? null }, 'the engine’s card')
})

t.test('issue 19: P’s prompt logprobs reach the client; D, which read the KV, has none of its own', async (t) => {
  const { p, d, url } = await pair(t, [])
  for (const [path, body, where] of [
    ['/v1/completions', { prompt: 'the logprobs of a prompt' }, (j: { choices: { prompt_logprobs?: unknown }[]; prompt_logprobs?: unknown }) => j.choices[0]?.prompt_logprobs],
    ['/v1/chat/completions', { messages: [{ role: 'user', content: 'the logprobs of a chat' }] }, (j: { choices: { prompt_logprobs?: unknown }[]; prompt_logprobs?: unknown }) => j.prompt_logprobs],
  ] as const) {
    const full = { model: MODEL, max_tokens: 3, prompt_logprobs: 1, ...body }
    const routed = await post(`${url}${path}`, full)
    t.equal(routed.status, 200)
    const direct = await post(`${p.url}${path}`, full)
    const expected = where(direct.json())
    t.ok(Array.isArray(expected) && expected.length > 2, `one engine that computes the prompt gives its logprobs (${path})`)
    t.same(where(routed.json()), expected, `the router's answer carries P's (${path})`)
    const dLeg = (await completions(d)).filter((r) => r.path === path).at(-1)
    t.ok(readKv(dLeg), 'D read the prompt’s KV from P (so its own answer had null)')
  }
})
