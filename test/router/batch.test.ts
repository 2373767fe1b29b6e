import t from 'tap'
import { Readable } from 'node:stream'
import { mergeStreams, splitRequest } from '../../router/src/proxy/batch.js'
import { get, post, simRequests, sseEvents, startRouter, startSim } from '../helpers/cluster.js'

// Issue 6 item 4: vLLM returns kv_transfer_params for a batch's first prompt only, so the
// router splits a batch into one handoff per prompt and merges the answers in order.
const p = await startSim(t, ['--role', 'prefill', '--seed', '41'])
const d = await startSim(t, ['--role', 'decode', '--seed', '42', '--decode-delay-ms', '5'])
const { url } = await startRouter(
  t,
  [
    { id: 'p0', role: 'prefill', url: p.url },
    { id: 'd0', role: 'decode', url: d.url },
  ],
  { probe: false },
)
const MODEL = 'handoff/sim-1'
const prompts = ['the first prompt', 'a second, longer prompt with more words', 'third']

type Choice = { index: number; text: string; finish_reason: string | null }
type Usage = { prompt_tokens: number; completion_tokens: number; total_tokens: number }

async function single(prompt: string): Promise<{ text: string; usage: Usage }> {
  const res = await post(`${url}/v1/completions`, { model: MODEL, prompt, max_tokens: 6 })
  const body = res.json<{ choices: Choice[]; usage: Usage }>()
  return { text: (body.choices[0] as Choice).text, usage: body.usage }
}

async function clear(): Promise<void> {
  await post(`${p.url}/sim/requests/clear`, {})
  await post(`${d.url}/sim/requests/clear`, {})
}

t.test('a non-streamed batch: one handoff per prompt, choices in order, usage summed', async (t) => {
  const expected = await Promise.all(prompts.map(single))
  await clear()
  const res = await post(`${url}/v1/completions`, { model: MODEL, prompt: prompts, max_tokens: 6 })
  t.equal(res.status, 200)
  const body = res.json<{ choices: Choice[]; usage: Usage; kv_transfer_params?: unknown }>()
  t.same(
    body.choices.map((c) => [c.index, c.text]),
    expected.map((e, i) => [i, e.text]),
    'each prompt got its own text, by index',
  )
  t.equal(body.usage.prompt_tokens, expected.reduce((a, e) => a + e.usage.prompt_tokens, 0))
  t.equal(body.usage.completion_tokens, expected.reduce((a, e) => a + e.usage.completion_tokens, 0))
  t.notOk(body.kv_transfer_params, 'no handoff params leak to the client')
  const prefills = (await simRequests(p)).filter((r) => r.path === '/v1/completions')
  const decodes = (await simRequests(d)).filter((r) => r.path === '/v1/completions')
  t.equal(prefills.length, 3, 'three prefill legs')
  t.same(prefills.map((r) => r.body.prompt).sort(), [...prompts].sort(), 'one prompt each')
  t.equal(new Set(prefills.map((r) => r.headers['x-request-id'])).size, 3, 'three engine request ids')
  t.ok(decodes.every((r) => typeof r.body.prompt === 'string' && (r.body.kv_transfer_params as { do_remote_prefill?: boolean }).do_remote_prefill), 'every D leg read its own KV')
})

t.test('a streamed batch interleaves choices by index, sums usage once, ends with one [DONE]', async (t) => {
  const expected = await Promise.all(prompts.map(single))
  const res = await post(`${url}/v1/completions`, { model: MODEL, prompt: prompts, max_tokens: 6, stream: true, stream_options: { include_usage: true } })
  t.equal(res.status, 200)
  const events = sseEvents(res.text)
  t.equal(events.filter((e) => e === '[DONE]').length, 1)
  t.equal(events.at(-1), '[DONE]')
  const texts = ['', '', '']
  const usages: Usage[] = []
  const ids = new Set<unknown>()
  for (const e of events) {
    if (e === '[DONE]') continue
    ids.add(e.id)
    for (const c of e.choices as Choice[]) texts[c.index] += c.text
    if (e.usage) usages.push(e.usage as Usage)
  }
  t.same(texts, expected.map((e) => e.text))
  t.equal(usages.length, 1, 'one usage chunk')
  t.equal(usages[0]?.completion_tokens, expected.reduce((a, e) => a + e.usage.completion_tokens, 0))
  t.equal(ids.size, 1, 'one id across the batch')
})

t.test('a batch of one prompt, and a list of token ids, are single prompts', async (t) => {
  await clear()
  const res = await post(`${url}/v1/completions`, { model: MODEL, prompt: ['only one'], max_tokens: 4 })
  t.equal(res.status, 200)
  t.equal(res.json<{ choices: Choice[] }>().choices.length, 1)
  const prefills = (await simRequests(p)).filter((r) => r.path === '/v1/completions')
  t.equal(prefills[0]?.body.prompt, 'only one')
})

t.test("one prompt's failure answers for the batch", async (t) => {
  // D refuses more tokens than the model allows (P got max_tokens 1): D's 400 is relayed.
  const res = await post(`${url}/v1/completions`, { model: MODEL, prompt: ['ok', 'fine'], max_tokens: 10_000_000 })
  t.equal(res.status, 400)
})

t.test("a streamed batch whose engine sends an error event: passed on as it came, then [DONE], and the batch ends", async (t) => {
  await post(`${d.url}/sim/faults`, { kvLoadFailureRate: 1 })
  t.teardown(() => post(`${d.url}/sim/faults`, { kvLoadFailureRate: 0 }))
  const res = await post(`${url}/v1/completions`, { model: MODEL, prompt: prompts, max_tokens: 6, stream: true })
  t.equal(res.status, 200)
  const events = sseEvents(res.text)
  t.match(events, [{ error: { code: 'SIM_ERR_KV_LOAD_FAILED' } }, '[DONE]'], "one engine's error event, untouched (no choices or id added), then [DONE]")
  t.notOk('choices' in (events[0] as object), 'the error event is not reshaped as a chunk')
  t.match((await get(`${url}/metrics`)).text, /handoff_router_requests_total\{mode="pd",outcome="engine_error_event"\} 1/, 'counted as failed, not ok')
})

t.test('splitRequest: prompts × n choices, prompt-major, n: 1 each, seeds spread over the choices', async (t) => {
  t.equal(splitRequest({ model: MODEL, prompt: 'one' }, '/v1/completions'), undefined, 'one prompt, one choice: one handoff as it is')
  t.equal(splitRequest({ model: MODEL, messages: [], n: 1 }, '/v1/chat/completions'), undefined)
  const chat = splitRequest({ model: MODEL, messages: [{ role: 'user', content: 'x' }], n: 3, seed: 7 }, '/v1/chat/completions')
  t.same(
    chat?.map((s) => [s.prompt, s.choice, s.index, s.body.n, s.body.seed]),
    [
      [0, 0, 0, 1, 7],
      [0, 1, 1, 1, 8],
      [0, 2, 2, 1, 9],
    ],
  )
  const batch = splitRequest({ model: MODEL, prompt: ['a', 'b'], n: 2 }, '/v1/completions')
  t.same(
    batch?.map((s) => [s.body.prompt, s.index, s.body.n, 'seed' in s.body]),
    [
      ['a', 0, 1, false],
      ['a', 1, 1, false],
      ['b', 2, 1, false],
      ['b', 3, 1, false],
    ],
  )
  // Chat bodies have no batches: a `prompt` field there is just passed on.
  t.equal(splitRequest({ model: MODEL, prompt: ['a', 'b'] }, '/v1/chat/completions'), undefined)
})

t.test('a request that fans out past limits.maxHandoffsPerRequest is refused before any leg, coded', async (t) => {
  const r = await startRouter(
    t,
    [
      { id: 'p0', role: 'prefill', url: p.url },
      { id: 'd0', role: 'decode', url: d.url },
    ],
    { probe: false, limits: { bodyBytes: 1 << 20, connectionsPerUpstream: 8, maxInflightPerInstance: 8, maxHandoffsPerRequest: 4, maxAgents: 1024 } },
  )
  await clear()
  const res = await post(`${r.url}/v1/completions`, { model: MODEL, prompt: ['a', 'b', 'c'], n: 2, max_tokens: 2 })
  t.equal(res.status, 400)
  t.match(res.json(), { error: { code: 'RTR_ERR_TOO_MANY_HANDOFFS', message: /needs 6 handoffs .* \(4\)/ } })
  t.same(await simRequests(p), [], 'no prefill was spent')
  t.equal((await post(`${r.url}/v1/completions`, { model: MODEL, prompt: ['a', 'b'], n: 2, max_tokens: 2 })).status, 200, 'at the limit: served')
})

t.test('mergeStreams: a character whose bytes arrive in two reads is whole in the merged stream', async (t) => {
  const subs = splitRequest({ model: MODEL, prompt: ['a', 'b'] }, '/v1/completions') ?? []
  const frame = (text: string) => Buffer.from(`data: ${JSON.stringify({ id: 'x', object: 'text_completion', choices: [{ index: 0, text, finish_reason: null }] })}\n\n`)
  const split = (buf: Buffer, at: number) => Readable.from([buf.subarray(0, at), buf.subarray(at)])
  const euro = frame('€ sign')
  // Cut inside the three bytes of €.
  const at = euro.indexOf(Buffer.from('€')) + 1
  let out = ''
  for await (const s of mergeStreams({ model: MODEL }, subs, [split(euro, at), Readable.from([frame('ö')])])) out += s
  const texts = sseEvents(out)
    .filter((e): e is Record<string, unknown> => e !== '[DONE]')
    .map((e) => (e.choices as Choice[])[0]?.text)
  t.same(texts.sort(), ['ö', '€ sign'].sort())
})
