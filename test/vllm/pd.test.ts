import t from 'tap'
import { request } from 'undici'
import { parseEngineLoad } from '../../router/src/admission/engine-load.js'
import { sseEvents, startRouter, streamedText, waitFor } from '../helpers/cluster.js'
import { SimEngine } from '../helpers/sim-engine.js'
import { call, errorCode, isLateRead, MODEL, needVllm, startVllm, texts, type Answer, type Choice, type VllmEngine } from '../helpers/vllm.js'

/*
 * Issue 19: the router in front of real vLLM 0.32 engines doing P/D over NIXL (CPU, UCX on
 * loopback). Every answer through the router is compared with the same request sent straight
 * to one engine with greedy decoding, and D's vllm:prompt_tokens_by_source_total proves the
 * prompt's KV came over NIXL (external_kv_transfer), not from D computing it again.
 *
 * P doubles as the single-engine reference: a request without kv_transfer_params is served by
 * a producer like any engine. Prompts are short (under vLLM's 128-token block), so no prefix
 * cache on D can serve them: every handoff must pull.
 *
 * The same cases run against the simulator (test/helpers/sim-engine.ts), so it is held to what
 * vLLM does: where they differ, the simulator is wrong. What the simulator does not model
 * (logprobs, prompt_tokens_details) is asserted on vLLM only.
 */

const ADMIN = 'admin-token-vllm'

/** An engine of either kind: VllmEngine or SimEngine. */
type Engine = Pick<VllmEngine, 'url' | 'name' | 'signal' | 'stop' | 'launch' | 'tail' | 'metric' | 'series' | 'promptTokens' | 'kvEvents'>

interface Backend {
  name: string
  skip: string | false
  start(t: Parameters<typeof startVllm>[0]): Promise<[Engine, Engine]>
  /** vLLM only: logprobs and usage.prompt_tokens_details (the simulator has neither). */
  real: boolean
}

// vLLM's block on CPU (128 tokens), so the prefix case's block arithmetic holds for both.
const SIM_ARGS = ['--model', MODEL, '--max-model-len', '1024', '--block-size', '128', '--num-gpu-blocks-override', '512']
const backends: Backend[] = [
  {
    name: 'real vLLM',
    skip: needVllm(t),
    // Both publish KV events, which the router indexes for prefix-aware routing (issue 39).
    start: async (t) => (await startVllm(t, [{ role: 'prefill', kvEvents: true }, { role: 'decode', kvEvents: true }])) as [VllmEngine, VllmEngine],
    real: true,
  },
  {
    name: 'the simulator',
    skip: false,
    // D paces its tokens (5 ms) so a long stream is still running when a case cuts it.
    start: async (t) => [
      await SimEngine.start(t, 'prefill', SIM_ARGS, { kvEvents: true }),
      await SimEngine.start(t, 'decode', [...SIM_ARGS, '--decode-delay-ms', '5'], { kvEvents: true }),
    ],
    real: false,
  },
]
// Engines start in 35-90 s; each first handoff handshakes (5-28 s).
t.setTimeout(900_000)

let n = 0
/** A prompt no earlier case used (D's prefix cache must not serve it). */
const prompt = (tag: string): string => `${tag} ${n++} the quick brown fox jumps over the lazy dog and the kv cache block lease`

/** The first finish_reason a stream's events carry (undefined: the stream never finished). */
function finishReason(events: ReturnType<typeof sseEvents>): unknown {
  return events.map((e) => (e === '[DONE]' ? undefined : (e.choices as Choice[] | undefined)?.[0]?.finish_reason)).find((r) => r)
}

for (const backend of backends) t.test(`the router in front of ${backend.name} P/D`, { skip: backend.skip }, async (t) => {
  const [P, D] = await backend.start(t)
  const { url, app } = await startRouter(
    t,
    [
      { id: 'p0', role: 'prefill', url: P.url, ...(P.kvEvents ? { kvEvents: P.kvEvents } : {}) },
      { id: 'd0', role: 'decode', url: D.url, ...(D.kvEvents ? { kvEvents: D.kvEvents } : {}) },
    ],
    // A decode leg vLLM never answers (see the restart case) ends in 30 s, not the default 120 s.
    {
      adminToken: ADMIN,
      // A decode stream that stops sending ends in 60 s, before the test client's 120 s.
      // A prefill (under a second here) that takes 30 s is a hung engine (see the D-kill case).
      timeouts: { prefillMs: 30_000, decodeHeadersMs: 30_000, idleMs: 60_000 },
      // Probes often enough that a restarted P is back in routing within seconds.
      health: { intervalMs: 500, timeoutMs: 2000, unhealthyThreshold: 3, baseEjectionMs: 1000, maxEjectionMs: 2000 },
    },
  )

  /** Sends `body` through the router and straight to P; returns both, and how many prompt tokens D pulled over NIXL meanwhile. */
  const both = async (path: string, body: Record<string, unknown>): Promise<{ routed: Answer; direct: Answer; pulled: number; computed: number }> => {
    const before = await D.promptTokens()
    const started = performance.now()
    const routed = await call(url, path, body)
    const routedMs = performance.now() - started
    const after = await D.promptTokens()
    // One engine, one choice: greedy choices are all alike, and a producer refuses nothing.
    const direct = await call(P.url, path, { ...body, n: 1 })
    t.comment(`${path} ${JSON.stringify(body).slice(0, 60)}…: router ${Math.round(routedMs)} ms, direct ${Math.round(performance.now() - started - routedMs)} ms`)
    const delta = (k: string): number => (after[k] ?? 0) - (before[k] ?? 0)
    return { routed, direct, pulled: delta('external_kv_transfer'), computed: delta('local_compute') }
  }

  await t.test('warm-up: the first handoff handshakes D with P', async (t) => {
    const started = performance.now()
    // D's first read waits for its NIXL handshake with P (5-28 s here, more on a loaded
    // machine): past the lease the router withholds the answer (RTR_ERR_LATE_READ) and the
    // next handoff finds the handshake done.
    // An engine's first logprobs answer took 10-30 s here (the first logprobs pass), too
    // close to the lease for a decode leg: each engine warms that path on a request of its own.
    for (const e of backend.real ? [P, D] : []) {
      // bench/vllm-site: without it each engine's NIXL progress thread spins a core.
      t.match(e.tail(1_000_000), /handoff: NIXL progress thread delay [1-9]\d* us/, `${e.name}'s NIXL progress thread waits instead of spinning`)
      const warmed = await call(e.url, '/v1/completions', { model: MODEL, prompt: prompt('lpwarm'), max_tokens: 2, temperature: 0, logprobs: 2, echo: true })
      t.comment(`${e.name}'s own logprobs warm-up: ${warmed.status} after ${Math.round(performance.now() - started)} ms`)
    }
    let r = await both('/v1/completions', { model: MODEL, prompt: prompt('warm'), max_tokens: 4, temperature: 0 })
    for (let i = 0; i < 2 && isLateRead(r.routed); i++) {
      t.comment(`first handoff withheld after ${Math.round(performance.now() - started)} ms: D's first token came past the lease`)
      r = await both('/v1/completions', { model: MODEL, prompt: prompt('warm'), max_tokens: 4, temperature: 0 })
    }
    const { routed, direct, pulled, computed } = r
    t.comment(`first handoff ${Math.round(performance.now() - started)} ms`)
    t.equal(routed.status, 200, 'answered 200', { body: routed.text.slice(0, 500) })
    t.same(texts(routed), texts(direct), 'the same greedy text as one engine')
    t.ok(pulled > 0, `D pulled ${pulled} prompt tokens over NIXL`)
    t.equal(computed, 0, 'and computed none of the prompt itself')
  })

  await t.test('completions, JSON', async (t) => {
    const { routed, direct, pulled, computed } = await both('/v1/completions', { model: MODEL, prompt: prompt('json'), max_tokens: 12, temperature: 0 })
    t.equal(routed.status, 200, 'answered 200', { body: routed.text.slice(0, 500) })
    t.same(texts(routed), texts(direct))
    t.equal(routed.json<{ usage: { completion_tokens: number } }>().usage.completion_tokens, 12)
    const cached = (a: Answer): unknown => a.json<{ usage: { prompt_tokens_details?: { cached_tokens?: number } } }>().usage.prompt_tokens_details?.cached_tokens
    if (backend.real) t.equal(cached(routed), cached(direct), `cached_tokens as one engine counts them (${String(cached(direct))}), from P`)
    t.ok(pulled > 0 && computed === 0, `KV over NIXL (${pulled} pulled, ${computed} computed)`)
  })

  await t.test('completions, SSE with include_usage', async (t) => {
    const body = { model: MODEL, prompt: prompt('sse'), max_tokens: 10, temperature: 0 }
    const { routed, pulled } = await both('/v1/completions', { ...body, stream: true, stream_options: { include_usage: true } })
    const direct = await call(P.url, '/v1/completions', body)
    t.equal(routed.status, 200)
    t.equal(streamedText(routed.text), texts(direct)[0], 'the streamed text is the greedy text')
    const events = sseEvents(routed.text)
    t.equal(events.at(-1), '[DONE]')
    const usage = events.find((e) => e !== '[DONE]' && e.usage) as { usage: { completion_tokens: number; prompt_tokens: number; prompt_tokens_details?: { cached_tokens?: number } } } | undefined
    t.equal(usage?.usage.completion_tokens, 10, 'a usage chunk with the decode leg’s count')
    const whole = direct.json<{ usage: { prompt_tokens_details?: { cached_tokens?: number } } }>().usage
    if (backend.real) t.equal(usage?.usage.prompt_tokens_details?.cached_tokens, whole.prompt_tokens_details?.cached_tokens, 'and cached_tokens as one engine counts them, from P')
    t.ok(pulled > 0, `KV over NIXL (${pulled})`)
  })

  await t.test('chat completions, JSON and SSE', async (t) => {
    const messages = [{ role: 'user', content: prompt('chat') }]
    const { routed, direct, pulled } = await both('/v1/chat/completions', { model: MODEL, messages, max_tokens: 8, temperature: 0 })
    t.equal(routed.status, 200, 'answered 200', { body: routed.text.slice(0, 500) })
    t.same(texts(routed), texts(direct))
    t.ok(pulled > 0, `KV over NIXL (${pulled})`)
    const messages2 = [{ role: 'user', content: prompt('chat-sse') }]
    const streamed = await both('/v1/chat/completions', { model: MODEL, messages: messages2, max_tokens: 8, temperature: 0, stream: true })
    const reference = await call(P.url, '/v1/chat/completions', { model: MODEL, messages: messages2, max_tokens: 8, temperature: 0 })
    t.equal(streamed.routed.status, 200)
    t.equal(streamedText(streamed.routed.text), texts(reference)[0])
    t.ok(streamed.pulled > 0, `KV over NIXL (${streamed.pulled})`)
  })

  await t.test('a batch of prompts: one handoff each, merged in order', async (t) => {
    const prompts = [prompt('batch'), prompt('batch'), prompt('batch')]
    const { routed, direct, pulled } = await both('/v1/completions', { model: MODEL, prompt: prompts, max_tokens: 6, temperature: 0 })
    t.equal(routed.status, 200, 'answered 200', { body: routed.text.slice(0, 500) })
    t.same(texts(routed), texts(direct))
    t.equal(texts(routed).length, 3)
    t.ok(pulled > 0, `KV over NIXL (${pulled})`)
  })

  await t.test('n > 1: each choice reads its own lease', async (t) => {
    const body = { model: MODEL, prompt: prompt('n2'), max_tokens: 6, temperature: 0, n: 2 }
    const { routed, direct, pulled } = await both('/v1/completions', body)
    t.equal(routed.status, 200, 'answered 200', { body: routed.text.slice(0, 500) })
    const one = texts(direct)[0]
    t.same(texts(routed), [one, one], 'two greedy choices, each the one engine’s')
    t.same(
      routed.json<{ choices: Choice[] }>().choices.map((c) => c.index).sort(),
      [0, 1],
    )
    t.ok(pulled > 0, `KV over NIXL (${pulled})`)
    t.notMatch(P.tail(200), /Potentially invalid KV blocks/, 'P saw no read of freed blocks')
  })

  await t.test('refused before the prefill leg: what D would refuse never costs P a prefill', async (t) => {
    const before = await P.promptTokens()
    const body = { model: MODEL, prompt: prompt('refused'), max_tokens: 4, stream_options: { include_usage: true } }
    const routed = await call(url, '/v1/completions', body)
    const direct = await call(D.url, '/v1/completions', body)
    t.equal(routed.status, 400, 'the router answers 400')
    t.equal(direct.status, 400, 'as vLLM does')
    const message = direct.json<{ error: { message: string } }>().error.message
    t.match(routed.json<{ error: { message: string } }>().error.message, message.replace(/^.*(Stream options[^.]*\.).*$/s, '$1'), `with vLLM's message: ${message}`)
    const after = await P.promptTokens()
    t.same(after, before, 'P computed nothing for it')
  })

  await t.test('/v1/models: the engine’s card', async (t) => {
    const res = await request(`${url}/v1/models`)
    const card = ((await res.body.json()) as { data: Record<string, unknown>[] }).data[0]
    const engine = ((await (await request(`${P.url}/v1/models`)).body.json()) as { data: Record<string, unknown>[] }).data[0]
    t.match(card, { id: MODEL, max_model_len: 1024, root: engine?.root, owned_by: 'vllm' })
  })

  await t.test('stop, max_tokens 1, logprobs', async (t) => {
    const p = prompt('stop')
    const full = texts(await call(P.url, '/v1/completions', { model: MODEL, prompt: p, max_tokens: 8, temperature: 0 }))[0] as string
    const stop = full.slice(3, 5)
    const { routed, direct } = await both('/v1/completions', { model: MODEL, prompt: p, max_tokens: 8, temperature: 0, stop: [stop] })
    t.equal(routed.status, 200, 'answered 200', { body: routed.text.slice(0, 500) })
    t.same(texts(routed), texts(direct), `stopped at ${JSON.stringify(stop)}`)
    t.equal(routed.json<{ choices: Choice[] }>().choices[0]?.finish_reason, 'stop')

    const one = await both('/v1/completions', { model: MODEL, prompt: prompt('one'), max_tokens: 1, temperature: 0 })
    t.equal(one.routed.status, 200, 'answered 200', { body: one.routed.text.slice(0, 500) })
    t.same(texts(one.routed), texts(one.direct), 'max_tokens 1')

    // The simulator computes no logprobs.
    if (backend.real) {
      const lp = await both('/v1/completions', { model: MODEL, prompt: prompt('lp'), max_tokens: 4, temperature: 0, logprobs: 2 })
      t.equal(lp.routed.status, 200, 'answered 200', { body: lp.routed.text.slice(0, 500) })
      const tokens = (a: Answer): unknown => (a.json<{ choices: { logprobs: { tokens: string[] } }[] }>().choices[0]?.logprobs.tokens)
      t.same(tokens(lp.routed), tokens(lp.direct), 'the same logprob tokens')

      // echo: the prompt's tokens and their logprobs come first; only P computed those.
      const echo = await both('/v1/completions', { model: MODEL, prompt: prompt('echo'), max_tokens: 3, temperature: 0, logprobs: 1, echo: true })
      t.equal(echo.routed.status, 200, 'answered 200', { body: echo.routed.text.slice(0, 500) })
      type Lp = { tokens: string[]; token_logprobs: (number | null)[] }
      const echoLp = (a: Answer): Lp => a.json<{ choices: { logprobs: Lp }[] }>().choices[0]?.logprobs as Lp
      t.same(texts(echo.routed), texts(echo.direct), 'echo: the prompt, then the greedy text')
      t.same(echoLp(echo.routed).tokens, echoLp(echo.direct).tokens, 'echo: the same tokens')
      const near = echoLp(echo.routed).token_logprobs.map((v, i) => {
        const w = echoLp(echo.direct).token_logprobs[i]
        return v === w || (typeof v === 'number' && typeof w === 'number' && Math.abs(v - w) < 1e-3)
      })
      t.ok(near.length > 0 && near.every(Boolean), `echo: the same logprobs, the prompt's from P (${JSON.stringify(echoLp(echo.routed).token_logprobs.slice(0, 4))}… vs ${JSON.stringify(echoLp(echo.direct).token_logprobs.slice(0, 4))}…)`)
    }

    // D read the prompt's KV instead of computing it: only P has the prompt's logprobs.
    const plp = await both('/v1/completions', { model: MODEL, prompt: prompt('plp'), max_tokens: 2, temperature: 0, prompt_logprobs: 1 })
    t.equal(plp.routed.status, 200, 'answered 200', { body: plp.routed.text.slice(0, 500) })
    const promptLp = (a: Answer): unknown => a.json<{ choices: { prompt_logprobs?: unknown }[] }>().choices[0]?.prompt_logprobs
    t.ok(Array.isArray(promptLp(plp.direct)), 'one engine gives the prompt’s logprobs')
    t.same(promptLp(plp.routed), promptLp(plp.direct), 'and so does the router, from P')

    // D has answered more than 8 non-streamed requests by now: its pace is known, and a read
    // of a request with max_tokens is proven by D's whole answer (leases.proveByWholeAnswer).
    const metrics = await (await fetch(`${url}/metrics`)).text()
    const whole = Number(/^handoff_router_whole_answer_reads_total (\d+)/m.exec(metrics)?.[1])
    t.ok(whole > 0, `${whole} reads proven by D's whole answer, answered as above`)
  })

  await t.test('prefix cache: the router’s index of both engines’ KV events predicts what each holds; a prompt D holds goes to D alone', async (t) => {
    const index = app.kv.index
    const tokenize = async (text: string): Promise<number[]> => {
      const r = await call(D.url, '/tokenize', { model: MODEL, prompt: text })
      t.equal(r.status, 200, 'the engine tokenizes', { body: r.text.slice(0, 300) })
      return r.json<{ tokens: number[] }>().tokens
    }
    /** What the router's index says `id` holds of the prompt, in tokens. */
    const held = (id: string, tokens: number[]): number => index.cachedTokens(id, index.prompt(tokens))
    const usageCached = (a: Answer): number | undefined => a.json<{ usage: { prompt_tokens_details?: { cached_tokens?: number } } }>().usage.prompt_tokens_details?.cached_tokens
    // Over three of vLLM's 128-token blocks, and new to both engines.
    const shared = Array.from({ length: 24 }, () => prompt('prefix')).join(' ')
    const first = `${shared} first question`
    const firstTokens = await tokenize(first)
    t.ok(firstTokens.length > 3 * 128 && firstTokens.length < 800, `a ${firstTokens.length}-token prompt`)

    // 1. A P/D handoff: P computes the prompt, D pulls it; each caches its full blocks and says so.
    const one = await both('/v1/completions', { model: MODEL, prompt: first, max_tokens: 4, temperature: 0 })
    t.equal(one.routed.status, 200, 'answered 200', { body: one.routed.text.slice(0, 500) })
    t.same(texts(one.routed), texts(one.direct))
    t.ok(one.pulled > 0, `D pulled ${one.pulled} prompt tokens`)
    const blocks = Math.floor((firstTokens.length - 1) / 128) * 128
    const indexed = await waitFor(() => held('p0', firstTokens) >= blocks && held('d0', firstTokens) >= blocks, 20_000)
    t.ok(indexed, `the index learned both engines hold its full blocks: P ${held('p0', firstTokens)}, D ${held('d0', firstTokens)} of ${firstTokens.length} tokens`)

    // 2. The shared prefix with a long new question (more than decodeOnly.maxUncachedTokens
    // uncached): P/D again, and P's own cached_tokens is what the index predicted for P.
    const second = `${shared} ${Array.from({ length: 8 }, () => prompt('second')).join(' ')}`
    const secondTokens = await tokenize(second)
    const predictedP = held('p0', secondTokens)
    t.ok(secondTokens.length - predictedP > 128, `${secondTokens.length - predictedP} tokens not cached: not for D alone`)
    const pBefore = await P.promptTokens()
    const routedSecond = await call(url, '/v1/completions', { model: MODEL, prompt: second, max_tokens: 4, temperature: 0 })
    t.equal(routedSecond.status, 200, 'answered 200', { body: routedSecond.text.slice(0, 500) })
    const pAfter = await P.promptTokens()
    t.ok(predictedP >= blocks, `the index predicted ${predictedP} cached tokens on P`)
    if (backend.real) t.equal(usageCached(routedSecond), predictedP, 'and P reported the same cached_tokens')
    t.equal((pAfter.local_cache_hit ?? 0) - (pBefore.local_cache_hit ?? 0), predictedP, "P's own prefix-cache hits match the prediction")

    // 3. The first prompt with a short new end: D holds all but a few tokens, so it serves the
    // request alone (no prefill leg, no read), from its own prefix cache.
    const third = `${first} and one more`
    const thirdTokens = await tokenize(third)
    const predictedD = held('d0', thirdTokens)
    t.ok(predictedD >= blocks && thirdTokens.length - predictedD <= 128, `the index predicted ${predictedD} of ${thirdTokens.length} tokens cached on D`)
    const [p3, d3] = [await P.promptTokens(), await D.promptTokens()]
    const routedThird = await call(url, '/v1/completions', { model: MODEL, prompt: third, max_tokens: 6, temperature: 0 })
    const [p3After, d3After] = [await P.promptTokens(), await D.promptTokens()]
    t.equal(routedThird.status, 200, 'answered 200', { body: routedThird.text.slice(0, 500) })
    t.same(p3After, p3, 'P computed nothing for it')
    const dDelta = (k: string): number => (d3After[k] ?? 0) - (d3[k] ?? 0)
    t.equal(dDelta('external_kv_transfer'), 0, 'D read nothing over NIXL')
    t.equal(dDelta('local_cache_hit'), predictedD, "D's own prefix-cache hits match the prediction")
    if (backend.real) t.equal(usageCached(routedThird), predictedD, 'and D reported the same cached_tokens')
    const direct = await call(P.url, '/v1/completions', { model: MODEL, prompt: third, max_tokens: 6, temperature: 0 })
    t.same(texts(routedThird), texts(direct), 'the same greedy text as one engine')
    const metrics = await (await fetch(`${url}/metrics`)).text()
    t.match(metrics, /^handoff_router_decode_only_total\{reason="held"\} [1-9]/m, 'counted as decode-only, held')
  })

  await t.test('a client that leaves mid-stream: D stops generating and frees its blocks', async (t) => {
    // As in the D-kill case below: the tiny model writes its 900 tokens in about a second, so
    // D can finish before this test looks (seen in CI: running 0, finish_reason "length").
    // Then the case has not happened yet; it is tried again, at most 3 times.
    const leaveMidStream = async (): Promise<{ ac: AbortController; running: number; finished?: unknown }> => {
      const ac = new AbortController()
      const res = await request(`${url}/v1/completions`, {
        method: 'POST',
        body: JSON.stringify({ model: MODEL, prompt: prompt('cancel'), max_tokens: 900, temperature: 0, ignore_eos: true, stream: true }),
        headers: { 'content-type': 'application/json' },
        signal: ac.signal,
      })
      t.equal(res.statusCode, 200)
      const it = (res.body as AsyncIterable<Buffer>)[Symbol.asyncIterator]()
      let text = String((await it.next()).value ?? '')
      const running = await D.metric('vllm:num_requests_running')
      if (running >= 1) return { ac, running }
      for (let r = await it.next(); !r.done; r = await it.next()) text += String(r.value)
      return { ac, running, finished: finishReason(sseEvents(text.slice(0, text.lastIndexOf('\n\n') + 2))) }
    }
    let left = await leaveMidStream()
    for (let attempt = 2; attempt <= 3 && left.running < 1 && left.finished !== undefined; attempt++) {
      t.comment(`D finished (${String(left.finished)}) before the test looked: attempt ${attempt}`)
      left = await leaveMidStream()
    }
    const { ac } = left
    t.ok(left.running >= 1, 'D is generating')
    // What adaptive admission reads of the engine (issue 23), from the engine's own page.
    const load = parseEngineLoad(await (await request(`${D.url}/metrics`)).body.text())
    t.ok(load && load.running >= 1 && load.waiting === 0, `admission reads D's load from /metrics: ${JSON.stringify(load)}`)
    ac.abort()
    const deadline = Date.now() + 10_000
    while (Date.now() < deadline && (await D.metric('vllm:num_requests_running')) > 0) await new Promise((r) => setTimeout(r, 100))
    t.equal(await D.metric('vllm:num_requests_running'), 0, 'D stopped the request')
    t.equal(await D.metric('vllm:kv_cache_usage_perc'), 0, 'and holds no KV for it')
    t.comment(`D's finished requests: ${JSON.stringify(await D.series('vllm:request_success_total'))}`)
  })

  await t.test('D killed mid-stream: the stream ends with a coded error event, nothing hangs; D comes back', async (t) => {
    // D is SIGKILLed when the first chunk reaches this test. The tiny model writes its 900
    // tokens in about a second, so on a loaded machine D can finish before the kill lands (seen
    // in CI: the stream ended with finish_reason "length" and [DONE], nothing to catch). Then
    // the case has not happened yet: D is brought back and the kill tried again, at most 3 times.
    const killMidStream = async (): Promise<{ events: ReturnType<typeof sseEvents>; finished: unknown }> => {
      const res = await request(`${url}/v1/completions`, {
        method: 'POST',
        body: JSON.stringify({ model: MODEL, prompt: prompt('dkill'), max_tokens: 900, temperature: 0, ignore_eos: true, stream: true }),
        headers: { 'content-type': 'application/json' },
        bodyTimeout: 60_000,
      })
      t.equal(res.statusCode, 200)
      let text = ''
      let killed = false
      for await (const chunk of res.body as AsyncIterable<Buffer>) {
        text += chunk.toString()
        if (!killed) {
          killed = true
          D.signal('SIGKILL')
        }
      }
      const events = sseEvents(text.slice(0, text.lastIndexOf('\n\n') + 2))
      return { events, finished: finishReason(events) }
    }
    // Until the probes put D back, and its first handoff (a new NIXL handshake) may come
    // past the lease (RTR_ERR_LATE_READ): a few tries, each bounded by the router's timeouts.
    // vLLM 0.32 on CPU: in 3 of 10 runs P's worker stopped answering after its decoder was
    // SIGKILLed (its EngineCore logged "No available shared memory broadcast block found in
    // 60 seconds" for 5 min, then died of a TimeoutError), so nothing P/D could be served.
    // That is vLLM's, not the router's: "serves again" is todo when P itself does not answer.
    const pAnswers = async (): Promise<boolean> => {
      try {
        const res = await request(`${P.url}/v1/completions`, {
          method: 'POST',
          body: JSON.stringify({ model: MODEL, prompt: prompt('palive'), max_tokens: 1 }),
          headers: { 'content-type': 'application/json' },
          headersTimeout: 15_000,
          bodyTimeout: 15_000,
        })
        await res.body.dump()
        return res.statusCode === 200
      } catch {
        return false
      }
    }
    const restartD = async (): Promise<{ again: Answer | undefined; pHung: boolean; codes: string[] }> => {
      await D.stop()
      await D.launch()
      let again: Answer | undefined
      let pHung = false
      const codes: string[] = []
      for (let i = 0; i < 8 && !pHung; i++) {
        again = await call(url, '/v1/completions', { model: MODEL, prompt: prompt('dback'), max_tokens: 4, temperature: 0 })
        codes.push(again.status === 200 ? '200' : String(errorCode(again) ?? again.status))
        if (again.status === 200) break
        pHung = !(await pAnswers())
        await new Promise((r) => setTimeout(r, 1000))
      }
      return { again, pHung, codes }
    }

    let run = await killMidStream()
    for (let attempt = 1; attempt < 3 && run.finished; attempt++) {
      t.comment(`D finished (${String(run.finished)}, ${run.events.length} events) before the SIGKILL landed: attempt ${attempt + 1}`)
      if ((await restartD()).pHung) break
      run = await killMidStream()
    }
    const { events } = run
    t.notOk(run.finished, 'D was killed before it finished', { finished: run.finished, events: events.length })
    t.equal(events.at(-1), '[DONE]', 'the stream ends')
    t.match(events.at(-2), { error: { code: /^RTR_ERR_UPSTREAM_/ } }, 'after a coded error event', { last: events.slice(-3), events: events.length })
    const { again, pHung, codes } = await restartD()
    t.comment(`after D's restart: ${codes.join(', ')}${pHung ? '; P itself does not answer (vLLM: its worker hung)' : ''}`)
    t.equal(again?.status, 200, 'the restarted decoder serves again', pHung ? { todo: 'vLLM 0.32 on CPU: P’s worker can hang after its decoder is SIGKILLed (docs/testing.md)' } : {})
  })

  // Last: it replaces P. seed 004: vLLM gives the restarted engine a new engine_id at the same
  // host:port, and D releases the old one's NIXL state once it handshakes with the new one.
  // What the router owes: the new engine_id, peer_gone for the old one, no wrong text, and
  // every request ended (200 or a coded error) in bounded time; all of that holds. What vLLM
  // 0.32 does here is not always what it should, so those assertions are todo: in 3 of 4 runs
  // with a D that had served the old P for minutes, D's worker stopped answering after P came
  // back ("No available shared memory broadcast block found in 60 seconds"; once after
  // logging "Remote engine ... changed from X to Y") and every decode leg timed out; in one
  // run P reaped a lease first and D then read the freed blocks ("Potentially invalid KV
  // blocks ... were retrieved by a decode worker"). With the D restarted by the case above it
  // passed (4 of 4). docs/testing.md.
  await t.test('P restarted at the same address: the router learns the new engine_id and logs peer_gone; no wrong text, nothing hangs', async (t) => {
    // Assertions about what vLLM does are todo (reported, not counted) until that is understood.
    const todo = 'vLLM 0.32 on CPU: D stops serving P/D after P restarts at its address (docs/testing.md)'
    const p0 = async (): Promise<{ engineId: string | null; state: string } | undefined> => {
      const res = await request(`${url}/topology`, { headers: { authorization: `Bearer ${ADMIN}` } })
      return ((await res.body.json()) as { instances: { id: string; engineId: string | null; state: string }[] }).instances.find((i) => i.id === 'p0')
    }
    const engineId = async (): Promise<string | null> => (await p0())?.engineId ?? null
    const old = await engineId()
    t.ok(old, `the router knows P's engine_id ${old}`)
    // The prefix case left P's and D's blocks in the router's index; P's go with P.
    const index = app.kv.index
    const [pBlocks, dBlocks] = [index.blocks('p0'), index.blocks('d0')]
    t.ok(pBlocks > 0, `the index holds ${pBlocks} blocks of P (and ${dBlocks} of D)`)
    await P.stop()
    await P.launch()
    // While P was refusing connections the router took it out of routing (D served alone);
    // the cases below are about P/D, so they start once the probes put P back.
    const back = Date.now() + 30_000
    while (Date.now() < back && (await p0())?.state !== 'ready') await new Promise((r) => setTimeout(r, 200))
    t.equal((await p0())?.state, 'ready', 'the restarted P is back in routing')
    const seen: string[] = []
    let wrong = 0
    let pulled = 0
    let computed = 0
    for (let i = 0; i < 2; i++) {
      const r = await both('/v1/completions', { model: MODEL, prompt: prompt('restart'), max_tokens: 6, temperature: 0 })
      const code = r.routed.status === 200 ? '200' : `${r.routed.status} ${String((JSON.parse(r.routed.text) as { error?: { code?: string } }).error?.code)}`
      seen.push(code)
      if (r.routed.status === 200 && JSON.stringify(texts(r.routed)) !== JSON.stringify(texts(r.direct))) wrong++
      if (r.routed.status !== 200) t.match(JSON.parse(r.routed.text), { error: { code: /^RTR_ERR_/ } }, `a failure is coded: ${code}`)
      pulled += r.pulled
      computed += r.computed
    }
    t.comment(`after the restart: ${seen.join(', ')}; D pulled ${pulled} prompt tokens over NIXL and computed ${computed} itself`)
    t.equal(wrong, 0, 'no client got another request’s text')
    // The simulator has no such fault: there, they must hold.
    t.ok(seen.includes('200'), 'requests are served after the restart', backend.real ? { todo } : {})
    t.ok(pulled > 0, 'and D read the new P’s KV over NIXL', backend.real ? { todo } : {})
    const fresh = await engineId()
    t.ok(fresh && fresh !== old, `the router learned the new engine_id ${fresh}`)
    const metrics = await (await request(`${url}/metrics`)).body.text()
    t.match(metrics, /handoff_router_events_total\{type="peer_gone"\} 1/, 'and logged peer_gone for the old one')
    // The new P holds nothing of the old one's cache (its prompts here fill no 128-token block).
    t.ok(await waitFor(() => index.blocks('p0') === 0), `the index forgot the old P's blocks (${index.blocks('p0')} left)`)
    t.equal(index.blocks('d0'), dBlocks, "and kept D's")
  })
})
