import t from 'tap'
import { post, startRouter, startSim } from '../helpers/cluster.js'

/*
 * Issue 19 §3: vLLM sends a non-streamed answer's head only when generation ends, so a
 * header deadline is a bound on the whole generation. A long non-streamed generation must not
 * be cut by timeouts.decodeHeadersMs (meant for a streamed head, which comes at once); it is
 * bounded by timeouts.generationMs, which the operator sets. That is a leg D answers whole:
 * a single route's, or a decode leg whose read D checks itself (leases.readCheck engine).
 * Where the router checks D's read, a non-streamed request's decode leg is streamed from D
 * (assemble.ts): its head comes at once and only the idle timeout bounds it.
 */
const MODEL = 'handoff/sim-1'

async function cluster(t: Parameters<typeof startSim>[0], timeouts: Record<string, number>, readCheck: 'engine' | 'router' = 'engine') {
  const p = await startSim(t, ['--role', 'prefill'])
  // 10 tokens at 300 ms each: the non-streamed head comes after 2.7 s at the earliest.
  const d = await startSim(t, ['--role', 'decode', '--decode-delay-ms', '300'])
  const { url } = await startRouter(
    t,
    [
      { id: 'p0', role: 'prefill', url: p.url },
      { id: 'd0', role: 'decode', url: d.url },
    ],
    { probe: false, timeouts, leases: { readCheck } } as Parameters<typeof startRouter>[2],
  )
  return url
}

t.test('a non-streamed generation longer than decodeHeadersMs completes within generationMs', async (t) => {
  // 2 s: shorter than the non-streamed generation, long enough for a stream's head on a loaded machine.
  const url = await cluster(t, { decodeHeadersMs: 2000, generationMs: 20_000 })
  const plain = await post(`${url}/v1/completions`, { model: MODEL, prompt: 'a long answer', max_tokens: 10 })
  t.equal(plain.status, 200, 'not cut at the 2 s header deadline')
  t.equal(plain.json<{ usage: { completion_tokens: number } }>().usage.completion_tokens, 10)
  const streamed = await post(`${url}/v1/completions`, { model: MODEL, prompt: 'a long stream', max_tokens: 10, stream: true })
  t.equal(streamed.status, 200, 'a stream’s head comes at once')
})

t.test('generationMs bounds a non-streamed generation: 504, coded', async (t) => {
  const url = await cluster(t, { decodeHeadersMs: 20_000, generationMs: 400 })
  const res = await post(`${url}/v1/completions`, { model: MODEL, prompt: 'too long', max_tokens: 10 })
  t.equal(res.status, 504)
  t.match(res.json(), { error: { code: 'RTR_ERR_UPSTREAM_TIMEOUT' } })
})

t.test('with the router checking reads, a non-streamed decode leg is streamed from D: generationMs does not cut it', async (t) => {
  const url = await cluster(t, { decodeHeadersMs: 2000, generationMs: 400 }, 'router')
  const res = await post(`${url}/v1/completions`, { model: MODEL, prompt: 'a long answer, assembled', max_tokens: 10 })
  t.equal(res.status, 200, 'not cut at the 400 ms generation bound', { body: res.text })
  const body = res.json<{ object: string; choices: { text: string; finish_reason: string }[]; usage: { completion_tokens: number } }>()
  t.equal(body.object, 'text_completion', 'one whole answer')
  t.equal(body.usage.completion_tokens, 10)
  t.equal(body.choices[0]?.finish_reason, 'length')
})
