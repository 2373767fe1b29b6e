import t from 'tap'
import { request } from 'undici'
import { freePort } from '../../common/ports.js'
import { get, sseEvents, startRouter, streamedText } from '../helpers/cluster.js'
import { startTcpProxy } from '../../bench/tcp-proxy.js'
import { call, errorCode, MODEL, needVllm, startVllm, texts, type Answer, type VllmEngine } from '../helpers/vllm.js'

/*
 * Issues 19 and 20: the KV lease with real vLLM 0.32 engines (P/D over NIXL on CPU), with an
 * 8 s kv_lease_duration so a decoder can be frozen past it in seconds. Its own pair of
 * engines: these cases freeze and kill them, and must not leave pd.test.ts's engines (stock
 * NixlConnector) in that state. D is frozen with SIGSTOP so that the order of events around
 * the lease is certain.
 *
 * These engines run handoff's connector (issue 20: transfer-agent/vllm), wired as in
 * production: they follow the router's agent event stream with the agent token. Everything
 * the stock connector does still happens (the cases of issue 19 hold unchanged); what it adds
 * is timed against what stock vLLM does on the same engines in the same run.
 */

const skip = needVllm(t)
const LEASE_S = 8
const AGENT = 'agent-token-vllm-lease'
const ADMIN = 'admin-token-vllm-lease'
// The router's probes: a refused probe this many times in a row, at this interval, is a crash.
// A frozen D is not refused but times out, and a probe round waits for its timeout: 8 rounds
// take 48 s, far beyond any freeze here (16 s at most).
const HEALTH = { intervalMs: 1000, timeoutMs: 5000, unhealthyThreshold: 8 }
t.setTimeout(900_000)

let n = 0
/** A prompt no earlier case used (D's prefix cache must not serve it). */
const prompt = (tag: string): string => `${tag} ${n++} the quick brown fox jumps over the lazy dog and the kv cache block lease`
const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms))

t.test('the KV lease with real vLLM P/D behind the router', { skip }, async (t) => {
  // The engines start first and follow the router at the port it will listen on.
  const routerPort = await freePort()
  const handoff = { routerUrls: [`http://127.0.0.1:${routerPort}`], token: AGENT }
  const [P, D] = (await startVllm(t, [
    { role: 'prefill', leaseSeconds: LEASE_S, handoff },
    { role: 'decode', leaseSeconds: LEASE_S, handoff },
  ])) as [VllmEngine, VllmEngine]
  // D behind a proxy the test can take down: a decoder that refuses connections, then is back.
  const dProxy = await startTcpProxy({ host: '127.0.0.1', port: D.port }, (stop) => t.teardown(stop))
  const { url } = await startRouter(
    t,
    [
      { id: 'p0', role: 'prefill', url: P.url },
      { id: 'd0', role: 'decode', url: dProxy.url },
    ],
    {
      listenPort: routerPort,
      agentToken: AGENT,
      adminToken: ADMIN,
      // The router judges reads by the engines' lease.
      leases: { leaseSeconds: LEASE_S, marginMs: 1000 },
      // A frozen D's stream head is waited for longer than it is frozen: the case is about
      // what the router does when D answers late, not about a timeout.
      timeouts: { decodeHeadersMs: 60_000, idleMs: 60_000 },
      health: HEALTH,
    },
  )
  const admin = { authorization: `Bearer ${ADMIN}` }
  const p0 = async () =>
    (await get(`${url}/topology`, admin)).json<{ instances: { id: string; engineId: string | null; agents: { kind: string; streams: number; acked: number | null }[] }[] }>().instances.find((i) => i.id === 'p0')

  const both = async (tag: string): Promise<{ routed: Answer; direct: Answer }> => {
    const body = { model: MODEL, prompt: prompt(tag), max_tokens: 4, temperature: 0 }
    return { routed: await call(url, '/v1/completions', body), direct: await call(P.url, '/v1/completions', body) }
  }
  /** A handoff until one is served: D's first reads after a start or a freeze wait for its NIXL handshake, maybe past the lease. */
  const served = async (t: { comment(...args: unknown[]): void }, tag: string): Promise<{ routed: Answer; direct: Answer }> => {
    let r = await both(tag)
    for (let i = 0; i < 4 && r.routed.status !== 200; i++) {
      t.comment(`${tag}: ${r.routed.status} ${String(errorCode(r.routed))}; again`)
      await sleep(1000)
      r = await both(tag)
    }
    return r
  }

  await t.test('warm-up: D handshakes with P; an answer past the lease is withheld, the next served', async (t) => {
    const started = Date.now()
    const r = await served(t, 'warm')
    t.comment(`served after ${Date.now() - started} ms`)
    t.equal(r.routed.status, 200, 'answered 200', { body: r.routed.text.slice(0, 300) })
    t.same(texts(r.routed), texts(r.direct), 'the greedy text')
  })

  await t.test('both engines follow the router’s events through handoff’s connector', async (t) => {
    const ms = Date.now()
    let prefill = await p0()
    while (Date.now() - ms < 30_000 && !(prefill?.agents.some((a) => a.streams > 0) && prefill.engineId)) {
      await sleep(200)
      prefill = await p0()
    }
    t.match(prefill?.agents, [{ kind: 'vllm-connector', streams: 1 }], 'P’s connector registered at P’s URL and holds a stream')
    t.ok(prefill?.engineId, `the router knows P’s engine_id ${prefill?.engineId} from its answers`)
    t.match(D.tail(400), /follows the router's events/, 'D’s connector follows the router too')
  })

  /** A router counter summed over its label sets. */
  const routerMetric = async (name: string, labels = ''): Promise<number> => {
    const text = await (await request(`${url}/metrics`)).body.text()
    let sum = 0
    for (const m of text.matchAll(new RegExp(`^${name}(\\{[^}]*\\})? ([0-9.e+-]+)$`, 'gm'))) if ((m[1] ?? '').includes(labels)) sum += Number(m[2])
    return sum
  }
  /** Waits until P has finished `n` more requests than `before` (its prefill legs). */
  const prefilled = async (before: number, n: number): Promise<void> => {
    const deadline = Date.now() + 60_000
    while (Date.now() < deadline && (await P.metric('vllm:request_success_total')) < before + n) await sleep(100)
  }

  // vLLM 0.32's pull mode does not check a read against P's lease (only its turn-2 readback
  // does): a decoder frozen past kv_lease_duration (a frozen D sends no heartbeats)
  // reads blocks P already reaped and gave to other prompts, and decodes from them. Seen
  // before the router checked reads: 200 with another prompt's text. And a client that left
  // between the legs costs P its blocks for the whole lease: stock vLLM has nobody to say so.
  await t.test('D frozen past the lease: no answer from reused blocks reaches a client; a client that left between the legs holds P’s KV until the lease ends', async (t) => {
    const lateBefore = await routerMetric('handoff_router_late_reads_total')
    const abandonedBefore = await routerMetric('handoff_router_leases_abandoned_total', 'reason="client_gone"')
    const stalled = [prompt('stall'), prompt('stall'), prompt('stall')]
    const refs = await Promise.all(stalled.map(async (p) => texts(await call(P.url, '/v1/completions', { model: MODEL, prompt: p, max_tokens: 8, temperature: 0 }))[0]))
    const leaver = prompt('leaver')
    const done0 = await P.metric('vllm:request_success_total')
    D.signal('SIGSTOP')
    const stopped = Date.now()
    try {
      const sent = stalled.map((p, i) => call(url, '/v1/completions', { model: MODEL, prompt: p, max_tokens: 8, temperature: 0, ...(i === 2 ? { stream: true } : {}) }))
      // The leaving client: gone once P prefilled its prompt and the router sent D the params.
      const ac = new AbortController()
      const left = request(`${url}/v1/completions`, {
        method: 'POST',
        body: JSON.stringify({ model: MODEL, prompt: leaver, max_tokens: 8, temperature: 0 }),
        headers: { 'content-type': 'application/json' },
        signal: ac.signal,
      }).catch(() => undefined)
      await prefilled(done0, 4)
      const held = await P.metric('vllm:kv_cache_usage_perc')
      ac.abort()
      await left
      t.ok(held > 0, `P holds the prompts' KV for D (kv_cache_usage_perc ${held})`)
      // P's lease runs out with no heartbeat from D; P reaps the blocks and prefills other
      // prompts into them.
      // (P reaps in its engine steps: the fillers make it step.)
      await sleep(LEASE_S * 1000 + 4000)
      for (let i = 0; i < 3; i++) await call(P.url, '/v1/completions', { model: MODEL, prompt: prompt('filler'), max_tokens: 2, temperature: 0 })
      const freed = await P.metric('vllm:kv_cache_usage_perc')
      t.comment(`P's KV usage ${Math.round((Date.now() - stopped) / 1000)} s after D froze: ${freed}`)
      t.equal(freed, 0, 'P freed every block at the lease’s end, the leaving client’s too (not before: nobody tells stock vLLM)')
      D.signal('SIGCONT')
      const answers = await Promise.all(sent)
      const seen: string[] = []
      let wrong = 0
      answers.forEach((a, i) => {
        const streamed = i === 2
        const text = streamed ? streamedText(a.text) : a.status === 200 ? texts(a)[0] : undefined
        const events = streamed ? sseEvents(a.text) : []
        const event = events.find((e): e is { error: { code: string } } => e !== '[DONE]' && 'error' in e)
        const code = a.status !== 200 ? String(errorCode(a)) : (event?.error.code ?? '200')
        seen.push(code)
        if (text && text !== refs[i]) wrong++
        if (code !== '200') t.match(code, /^RTR_ERR_/, `request ${i} ended with a coded error: ${code}`)
      })
      const late = (await routerMetric('handoff_router_late_reads_total')) - lateBefore
      const pLog = P.tail(400)
      t.comment(`answers: ${seen.join(', ')}; late reads withheld: ${late}; P logged ${(pLog.match(/Releasing expired KV blocks/g) ?? []).length} expired leases and ${(pLog.match(/Potentially invalid KV blocks/g) ?? []).length} reads after expiry`)
      t.equal(wrong, 0, 'no client got another prompt’s text')
      t.ok(late >= 1, 'the router withheld the late reads that reached D')
      t.equal((await routerMetric('handoff_router_leases_abandoned_total', 'reason="client_gone"')) - abandonedBefore, 1, 'the leaving client’s lease was left to P (D had its params)')
    } finally {
      D.signal('SIGCONT')
    }
    // D serves in time again (its first handoffs may still be behind: a few tries).
    const after = await served(t, 'thawed')
    t.equal(after.routed.status, 200, 'D serves again once thawed', { body: after.routed.text.slice(0, 300) })
    if (after.routed.status === 200) t.same(texts(after.routed), texts(after.direct))
  })

  // Issue 20: a lease nobody will read. The router knows at once (here: the only decoder
  // refuses the connection after P prefilled, so D never got the params) and logs a
  // lease_release for P. Stock vLLM has nobody to tell it and holds the blocks for
  // kv_lease_duration; P's handoff connector frees them on the event.
  await t.test('a lease nobody will read: the router’s lease_release frees P’s KV at once; stock vLLM holds it for the lease', async (t) => {
    t.ok(Number.isFinite(await P.msUntilNoKv(LEASE_S * 1000 + 5000)), 'P holds no KV before the case')
    const releasedBefore = await P.metric('vllm:handoff_leases_released_total')
    await dProxy.down()
    let answer: Answer
    try {
      answer = await call(url, '/v1/completions', { model: MODEL, prompt: prompt('refused'), max_tokens: 4, temperature: 0 })
    } finally {
      await dProxy.up()
    }
    const routed = await P.msUntilNoKv(5000)
    t.not(answer.status, 200, `D refused: the client gets a coded error (${answer.status} ${String(errorCode(answer))})`)
    t.equal((await get(`${url}/leases`, admin)).json<{ released: Record<string, number> }>().released.decode_failed, 1, 'the router released the lease (decode_failed)')
    t.equal((await P.metric('vllm:handoff_leases_released_total')) - releasedBefore, 1, 'P’s connector freed it on the router’s word (vllm:handoff_leases_released_total)')
    t.match(P.tail(400), /handoff: lease_release \(seq \d+, decode_failed\): freed the KV of 1 request/, 'and logged it')

    // The same P, stock behaviour: a prefill nobody reads and nobody releases (sent to P
    // directly, as a router's prefill leg is, with no router to tell P anything).
    const kvParams = { do_remote_decode: true, do_remote_prefill: false, remote_engine_id: null, remote_block_ids: null, remote_host: null, remote_port: null }
    const direct = await call(P.url, '/v1/completions', { model: MODEL, prompt: prompt('stock'), max_tokens: 1, ignore_eos: true, temperature: 0, kv_transfer_params: kvParams })
    t.equal(direct.status, 200)
    t.ok((await P.metric('vllm:kv_cache_usage_perc')) > 0, 'P holds that prompt’s KV for a decoder')
    const stock = await P.msUntilNoKv(LEASE_S * 1000 + 10_000)
    t.comment(`P's KV freed ${routed.toFixed(0)} ms after the client's answer with the router's lease_release; ${stock.toFixed(0)} ms without (kv_lease_duration ${LEASE_S} s): ${(stock / Math.max(routed, 1)).toFixed(0)}x`)
    t.ok(routed < 1000, `with the connector: freed in well under a second (${routed.toFixed(0)} ms)`)
    t.ok(stock >= (LEASE_S - 1) * 1000, `stock: held for the lease (${stock.toFixed(0)} ms)`)
    t.ok(stock / Math.max(routed, 1) >= 10, 'at least 10x sooner')
  })

  // P dies after its prefill, before D read the blocks (D frozen meanwhile, so the order is
  // certain). There is no other prefiller here to prefill again, so each request must end
  // with a clear error, in bounded time, and nothing wrong.
  await t.test('P killed between the legs: a clear error for each request, nothing hangs, nothing wrong', async (t) => {
    const done0 = await P.metric('vllm:request_success_total')
    const pEngine = (await p0())?.engineId
    D.signal('SIGSTOP')
    const started = Date.now()
    let killed = Date.now()
    let answers: Answer[]
    try {
      const sent = [false, true].map((stream) => call(url, '/v1/completions', { model: MODEL, prompt: prompt('pkill'), max_tokens: 6, temperature: 0, ...(stream ? { stream } : {}) }))
      await prefilled(done0, 2)
      P.signal('SIGKILL')
      killed = Date.now()
      await sleep(500)
      D.signal('SIGCONT')
      answers = await Promise.all(sent)
    } finally {
      D.signal('SIGCONT')
    }
    const [plain, streamed] = answers as [Answer, Answer]
    t.comment(`P killed between the legs: ${plain.status} ${plain.text.slice(0, 200)}; streamed ${streamed.status} …${streamed.text.slice(-200)} (${Date.now() - started} ms)`)
    t.not(plain.status, 200, 'the non-streamed request is not answered 200 (D read nothing)')
    t.match(errorCode(plain), /^RTR_ERR_/, 'it carries a router code')
    const events = sseEvents(streamed.text)
    if (streamed.status === 200) {
      t.equal(streamedText(streamed.text), '', 'the stream has no text')
      t.ok(events.some((e) => e !== '[DONE]' && 'error' in e), 'and ends with an error event')
    } else t.match(errorCode(streamed), /^RTR_ERR_/, 'the streamed request carries a router code')

    // Issue 20: P is gone and nothing replaces it. Stock vLLM keeps P's NIXL agent, descriptors
    // and metadata on D for engine_ttl (3600 s by default), or until another engine's
    // handshake evicts stale ones. The router sees P refuse its probes with no agent stream
    // open, declares it gone, and D's connector releases the state once no read uses it.
    const releaseLine = new RegExp(`Released NIXL state for replaced or locally invalid remote engine ${pEngine}`)
    let releasedAfter = Infinity
    while (Date.now() - killed < HEALTH.intervalMs * HEALTH.unhealthyThreshold + 30_000) {
      if ((await D.metric('vllm:handoff_peers_released_total')) >= 1 && releaseLine.test(D.tail(2000))) {
        releasedAfter = Date.now() - killed
        break
      }
      await sleep(100)
    }
    const ttl = 3600
    t.comment(`D released dead P's NIXL state ${releasedAfter} ms after P was killed (the router's probes: ${HEALTH.unhealthyThreshold} refused, ${HEALTH.intervalMs} ms apart, then peer_gone); stock vLLM: engine_ttl ${ttl} s: ${((ttl * 1000) / releasedAfter).toFixed(0)}x`)
    t.ok(Number.isFinite(releasedAfter), 'D’s connector released P’s NIXL state on the router’s peer_gone')
    t.match(D.tail(2000), new RegExp(`handoff: peer_gone ${pEngine}`), 'and logged why')
    t.ok((ttl * 1000) / releasedAfter >= 10, 'at least 10x sooner than stock vLLM')
    await P.stop()
  })

})
