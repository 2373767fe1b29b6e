import t from 'tap'
import { request } from 'undici'
import { freePort } from '../../common/ports.js'
import { get, post, sseEvents, spawnRouter, streamedText, waitFor } from '../helpers/cluster.js'
import { needRedis, startRedis } from '../helpers/redis.js'
import { startTcpProxy } from '../../bench/tcp-proxy.js'
import { drainUnderLoad } from '../../bench/drain-case.js'
import { call, errorCode, MODEL, needVllm, startVllm, texts, type Answer, type VllmEngine } from '../helpers/vllm.js'

/*
 * Issues 19 and 20: the KV lease with real vLLM 0.32 engines (P/D over NIXL on CPU), with an
 * 8 s kv_lease_duration so a decoder can be frozen past it in seconds. Its own engines: these
 * cases drain, freeze and kill them, and must not leave pd.test.ts's engines (stock
 * NixlConnector) in that state. D is frozen with SIGSTOP so that the order of events around
 * the lease is certain.
 *
 * These engines run handoff's connector (issue 20: transfer-agent/vllm), wired as in
 * production: they follow the router's agent event stream with the agent token, and the
 * router is a process on Redis, so that it can crash and come back with its event log.
 * Everything the stock connector does still happens (the cases of issue 19 hold unchanged);
 * what it adds is timed against what stock vLLM does on the same engines in the same run.
 * A second prefiller, P2, starts with them but joins the router only once P was killed (a
 * pod scaled up): it is then drained under load. Before, it idles, and it must: on 2 cores it
 * shares P's, and two busy engines on one core starve each other for a minute at a time.
 */

const skip = needVllm(t) || needRedis(t)
const LEASE_S = 8
const AGENT = 'agent-token-vllm-lease'
const ADMIN = 'admin-token-vllm-lease'
// The router's probes: a refused probe this many times in a row, at this interval, is a crash.
// A frozen D is not refused but times out, and a probe round waits for its timeout: 8 rounds
// take 48 s, far beyond any freeze here (16 s at most).
const HEALTH = { intervalMs: 1000, timeoutMs: 5000, unhealthyThreshold: 8 }
const ENGINE_TTL_S = 3600
t.setTimeout(900_000)

let n = 0
/** A prompt no earlier case used (D's prefix cache must not serve it). */
const prompt = (tag: string): string => `${tag} ${n++} the quick brown fox jumps over the lazy dog and the kv cache block lease`
const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms))
/** How often the engine's whole log matched `re` (a /g expression). */
const logged = (e: VllmEngine, re: RegExp): number => (e.tail(Number.POSITIVE_INFINITY).match(re) ?? []).length

t.test('the KV lease with real vLLM P/D behind the router', { skip }, async (t) => {
  // The engines start first and follow the router at the port it will listen on; P follows
  // it through a proxy the test can cut (events then wait for P in the router's log).
  const routerPort = await freePort()
  const pFollow = await startTcpProxy({ host: '127.0.0.1', port: routerPort }, (stop) => t.teardown(stop))
  const direct = { routerUrls: [`http://127.0.0.1:${routerPort}`], token: AGENT }
  // In this order, P and D get cores of their own; P2 gets P's, busy only once P is gone.
  const [P, D, P2] = (await startVllm(t, [
    { role: 'prefill', leaseSeconds: LEASE_S, handoff: { routerUrls: [pFollow.url], token: AGENT } },
    { role: 'decode', leaseSeconds: LEASE_S, handoff: direct },
    { role: 'prefill', leaseSeconds: LEASE_S, handoff: direct },
  ])) as [VllmEngine, VllmEngine, VllmEngine]
  // D behind a proxy the test can take down: a decoder that refuses connections, then is back.
  const dProxy = await startTcpProxy({ host: '127.0.0.1', port: D.port }, (stop) => t.teardown(stop))
  const redis = await startRedis(t)
  const router = await spawnRouter(t, {
    port: routerPort,
    agentToken: AGENT,
    adminToken: ADMIN,
    store: { kind: 'redis', url: redis.url },
    instances: [
      { id: 'p0', role: 'prefill', url: P.url },
      { id: 'd0', role: 'decode', url: dProxy.url },
    ],
    // The router judges reads by the engines' lease, each by D's first token: the cases freeze
    // D past the lease and count what P holds meanwhile, which a read proven by D's whole
    // answer would change (one past the window is prefilled again: whole-answer-read.test.ts;
    // pd.test.ts proves reads that way on real vLLM).
    leases: { leaseSeconds: LEASE_S, marginMs: 1000, proveByWholeAnswer: false },
    // A frozen D's stream head is waited for longer than it is frozen: the case is about
    // what the router does when D answers late, not about a timeout.
    timeouts: { decodeHeadersMs: 60_000, idleMs: 60_000 },
    health: HEALTH,
    // Registrations and agent streams show in its output (printed when a case fails).
    logLevel: 'info',
  })
  const url = router.url
  const admin = { authorization: `Bearer ${ADMIN}` }
  type InstanceView = { id: string; engineId: string | null; agents: { kind: string; streams: number; acked: number | null }[] }
  const instance = async (id: string): Promise<InstanceView | undefined> => (await get(`${url}/topology`, admin)).json<{ instances: InstanceView[] }>().instances.find((i) => i.id === id)
  const p0 = () => instance('p0')

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

  /** A request whose decode leg D refuses (nothing listens at its address): P prefilled it, and nobody will read it. */
  const refusedByD = async (tag: string): Promise<Answer> => {
    await dProxy.down()
    try {
      return await call(url, '/v1/completions', { model: MODEL, prompt: prompt(tag), max_tokens: 4, temperature: 0 })
    } finally {
      await dProxy.up()
    }
  }

  await t.test('warm-up: D handshakes with P; an answer past the lease is withheld, the next served', async (t) => {
    const started = Date.now()
    const r = await served(t, 'warm')
    t.comment(`served after ${Date.now() - started} ms`)
    t.equal(r.routed.status, 200, 'answered 200', { body: r.routed.text.slice(0, 300) })
    t.same(texts(r.routed), texts(r.direct), 'the greedy text')
  })

  await t.test('every engine follows the router’s events through handoff’s connector', async (t) => {
    const ms = Date.now()
    let prefill = await p0()
    while (Date.now() - ms < 30_000 && !(prefill?.agents.some((a) => a.streams > 0) && prefill.engineId)) {
      await sleep(200)
      prefill = await p0()
    }
    t.match(prefill?.agents, [{ kind: 'vllm-connector', streams: 1 }], 'P’s connector registered at P’s URL and holds a stream')
    t.ok(prefill?.engineId, `the router knows P’s engine_id ${prefill?.engineId} from its answers`)
    for (const [name, e] of [['D', D], ['P2', P2]] as const) t.match(e.tail(400), /follows the router's events/, `${name}’s connector follows the router too`)
  })

  /** The router's last lines of output (it logs at info here). */
  const routerLines = (): string => router.service.output().split('\n').slice(-60).join('\n')
  /** When P did not act on a router event: what P's connector and the router said, to tell delivery from the connector. */
  const explainP = async (t: { comment(...args: unknown[]): void }, pLogBefore: number): Promise<void> => {
    t.comment(`P's handoff lines since the case began:\n${P.tail(Number.POSITIVE_INFINITY).slice(pLogBefore).split('\n').filter((l) => /handoff|Releasing/.test(l)).slice(-40).join('\n')}`)
    t.comment(`P's agent at the router: ${JSON.stringify(await p0())}`)
    t.comment(`the router's last lines:\n${routerLines()}`)
  }

  /** A router counter summed over its label sets. */
  const routerMetric = async (name: string, labels = ''): Promise<number> => {
    const text = await (await request(`${url}/metrics`)).body.text()
    let sum = 0
    for (const m of text.matchAll(new RegExp(`^${name}(\\{[^}]*\\})? ([0-9.e+-]+)$`, 'gm'))) if ((m[1] ?? '').includes(labels)) sum += Number(m[2])
    return sum
  }
  /** Leases the router released because D failed (GET /leases). */
  const decodeFailed = async (): Promise<number> => (await get(`${url}/leases`, admin)).json<{ released: Record<string, number> }>().released.decode_failed ?? 0
  // Issue 20: the router crashes while an event waits for an engine. P's connector is cut off
  // from the router (its proxy down) when the router logs a lease_release for P; the router
  // is then SIGKILLed and started again on the same Redis. Once P reaches the new router, its
  // connector resumes after the last sequence it applied and gets the event from the log.
  // Whether it still finds the blocks held depends on the restart beating the 8 s lease: a
  // router serves once it has probed its engines, about 1 s on an idle machine but 6-10 s
  // here, where P's busy steps (it holds the lease) slow its /health and the router's own
  // start. So: the event is applied once, and the blocks are freed once, by it or P's reaper.
  await t.test('the router crashes while a lease_release waits for P: the restarted router delivers it from its log', async (t) => {
    t.ok(Number.isFinite(await P.msUntilNoKv(LEASE_S * 1000 + 5000)), 'P holds no KV before the case')
    const [releasedBefore, appliedBefore, reapedBefore] = [
      await P.metric('vllm:handoff_leases_released_total'),
      await P.metric('vllm:handoff_events_applied_total'),
      logged(P, /Releasing expired KV blocks/g),
    ]
    const ackedBefore = (await p0())?.agents[0]?.acked ?? 0
    const loggedBefore = await routerMetric('handoff_router_events_total', 'type="lease_release"')
    const pLogBefore = P.tail(Number.POSITIVE_INFINITY).length
    await pFollow.down()
    const answer = await refusedByD('pending')
    const answered = Date.now()
    t.not(answer.status, 200, `D refused: the router released the lease (${answer.status} ${String(errorCode(answer))})`)
    t.ok((await P.metric('vllm:kv_cache_usage_perc')) > 0, 'P still holds the KV: the lease_release waits in the log')
    // The crash comes once the event is in the log (the router logs its own decisions after
    // answering; one it had not logged yet dies with it, which is not this case).
    const inLog = await waitFor(async () => (await routerMetric('handoff_router_events_total', 'type="lease_release"')) > loggedBefore, 10_000)
    t.ok(inLog, 'the router logged the lease_release')
    if (!inLog) t.comment(`the router's last lines:\n${routerLines()}`)
    await router.restart()
    const restarted = Date.now() - answered
    await pFollow.up()
    const line = /handoff: lease_release \(seq (\d+), decode_failed\)/
    const applied = await waitFor(async () => (await P.metric('vllm:handoff_events_applied_total')) > appliedBefore, 15_000)
    t.ok(applied, 'P applied an event from the restarted router')
    if (!applied) {
      // Seen once in a fresh-clone run (fr29): what P's follower and the restarted router said.
      await explainP(t, pLogBefore)
    }
    t.equal((await P.metric('vllm:handoff_events_applied_total')) - appliedBefore, 1, 'exactly one')
    t.ok(Number.isFinite(await P.msUntilNoKv(LEASE_S * 1000)), 'P holds no KV')
    const byEvent = (await P.metric('vllm:handoff_leases_released_total')) - releasedBefore
    const byReaper = logged(P, /Releasing expired KV blocks/g) - reapedBefore
    t.equal(byEvent + byReaper, 1, 'the blocks were freed once')
    t.comment(`the router restarted ${restarted} ms after the client's answer; P's KV was freed by ${byEvent ? 'the lease_release' : 'its own reaper at the lease end'} (kv_lease_duration ${LEASE_S} s)`)
    if (byEvent) t.match(P.tail(400), line, 'and logged the lease_release')
    // The restarted router's view of the event P applied: after what P had applied before.
    const acked = await waitFor(async () => ((await p0())?.agents[0]?.acked ?? 0) > ackedBefore, 5000)
    const seq = (await p0())?.agents[0]?.acked ?? 0
    t.ok(acked, `P acknowledged seq ${seq} to the restarted router, after ${ackedBefore}, its last before the crash`)
    const delivery = (await get(`${url}/fault_tolerance/events/${seq}`, admin)).json<{ type: string; complete: boolean }>()
    t.match(delivery, { type: 'lease_release', complete: true }, 'the lease_release the old router logged, read from the shared log')
  })

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
    const releasedByRouter = await decodeFailed()
    const loggedBefore = await routerMetric('handoff_router_events_total', 'type="lease_release"')
    const pLogBefore = P.tail(Number.POSITIVE_INFINITY).length
    const answer = await refusedByD('refused')
    const routed = await P.msUntilNoKv(5000)
    t.not(answer.status, 200, `D refused: the client gets a coded error (${answer.status} ${String(errorCode(answer))})`)
    t.equal((await decodeFailed()) - releasedByRouter, 1, 'the router released the lease (decode_failed)')
    t.equal((await routerMetric('handoff_router_events_total', 'type="lease_release"')) - loggedBefore, 1, 'and logged a lease_release for P’s connector')
    const freed = (await P.metric('vllm:handoff_leases_released_total')) - releasedBefore
    t.equal(freed, 1, 'P’s connector freed it on the router’s word (vllm:handoff_leases_released_total)')
    t.match(P.tail(400), /handoff: lease_release \(seq \d+, decode_failed\): freed the KV of 1 request/, 'and logged it')
    if (freed !== 1) {
      // Seen once in CI (stop 30), not since.
      await explainP(t, pLogBefore)
    }

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
    // The ratio is measured (the comment above), not asserted: on a slow machine polling P's
    // metrics alone took 0.8 s of `routed` (fr6: 829 ms against 7,888, 9.5x).
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
    const ttl = ENGINE_TTL_S
    t.comment(`D released dead P's NIXL state ${releasedAfter} ms after P was killed (the router's probes: ${HEALTH.unhealthyThreshold} refused, ${HEALTH.intervalMs} ms apart, then peer_gone); stock vLLM: engine_ttl ${ttl} s: ${((ttl * 1000) / releasedAfter).toFixed(0)}x`)
    t.ok(Number.isFinite(releasedAfter), 'D’s connector released P’s NIXL state on the router’s peer_gone')
    t.match(D.tail(2000), new RegExp(`handoff: peer_gone ${pEngine}`), 'and logged why')
    t.ok((ttl * 1000) / releasedAfter >= 10, 'at least 10x sooner than stock vLLM')
    await P.stop()
  })

  // Issue 20: a prefiller scaled down. The chart's preStop hook drains it through the router
  // under load: the router sends it nothing new (P is dead: D serves the new requests alone)
  // and the hook returns once nothing of it is left, no request in flight, no lease unread.
  // Then the router logs peer_gone for its engine_id and D's connector releases its NIXL
  // state. Stock vLLM keeps that state on D for engine_ttl (3600 s by default), or until
  // another engine's handshake evicts stale ones.
  await t.test('P2 drained under load by the preStop hook: no failed request, no block left; D releases its NIXL state at once', async (t) => {
    // P2 joins, as discovery adds a pod that scaled up; D handshakes with it.
    const added = await post(`${url}/admin/instances`, { id: 'p2', role: 'prefill', url: P2.url }, admin)
    t.equal(added.status, 201, 'the router takes P2', { body: added.text })
    let warm = await call(url, '/v1/completions', { model: MODEL, prompt: prompt('p2-warm'), max_tokens: 4, temperature: 0 })
    for (let i = 0; i < 6 && warm.status !== 200; i++) {
      t.comment(`p2-warm: ${warm.status} ${String(errorCode(warm))}; again`)
      await sleep(1000)
      warm = await call(url, '/v1/completions', { model: MODEL, prompt: prompt('p2-warm'), max_tokens: 4, temperature: 0 })
    }
    t.equal(warm.status, 200, 'P/D serves through P2', { body: warm.text.slice(0, 300) })
    t.ok(await waitFor(async () => Boolean((await instance('p2'))?.agents.some((a) => a.streams > 0)), 10_000), 'P2’s connector holds a stream')
    const p2Engine = (await instance('p2'))?.engineId
    const run = await drainUnderLoad({ routerUrl: url, adminToken: ADMIN, instanceId: 'p2', drained: P2, decode: D, clients: 4, leadMs: 3000, prompt: () => prompt('drain') })
    t.comment(
      `drain: the hook returned after ${run.hookMs.toFixed(0)} ms (P2 held ${run.heldAtStart.inflight} in flight and ${run.heldAtStart.unreadLeases} unread lease(s) at its start); ` +
        `${run.requests} requests, ${run.failures.length} failed; P2 held no KV ${run.kvFreedMs.toFixed(0)} ms after; D released P2's NIXL state ${run.releasedMs.toFixed(0)} ms after the hook started; stock: engine_ttl ${ENGINE_TTL_S} s: ${((ENGINE_TTL_S * 1000) / run.releasedMs).toFixed(0)}x`,
    )
    t.comment(run.hook.stderr.trim())
    t.equal(run.hook.code, 0, 'the hook returned 0', { stderr: run.hook.stderr })
    t.match(run.hook.stderr, /p2 (drained after|gone from .* \(404: drained and removed)/, 'once P2 was drained')
    t.ok(run.heldAtStart.inflight + run.heldAtStart.unreadLeases > 0, `the hook started while P2 had work: ${run.heldAtStart.inflight} in flight, ${run.heldAtStart.unreadLeases} unread lease(s)`)
    const seen = run.drainSeen ?? { afterMs: Number.NaN, inflight: 0, maxAfter: 0 }
    t.ok(run.drainSeen, `the router showed P2 draining ${seen.afterMs.toFixed(0)} ms after the hook started (python3's start-up)`)
    t.ok(seen.maxAfter <= seen.inflight, `and sent it nothing new from then on (in flight: ${seen.inflight} then, at most ${seen.maxAfter} after)`)
    // fr20 (a fresh-clone run) failed here: 4 of 195 requests failed (502: D's KV load
    // failed) and P2 kept their blocks. The router had judged P2 drained while 4 leases of it
    // were still to be read: it counted the unread leases before the requests in flight, and
    // P2's batch of 4 prefills ended in between (fixed: drainer.ts reads in flight first;
    // test/store/shared-drain.test.ts). On failure, D's lines about P2 are printed.
    t.same(run.failures, [], `no request failed (${run.requests} in all)`)
    t.ok(Number.isFinite(run.kvFreedMs) && run.kvFreedMs < 2000, 'P2 holds no KV block: D read all of it')
    if (run.failures.length > 0 || !Number.isFinite(run.kvFreedMs)) {
      t.comment(`D's log about P2 (${p2Engine}):\n${D.tail(3000).split('\n').filter((l) => (p2Engine && l.includes(p2Engine)) || /handoff|KV load|invalid|Releasing/.test(l)).slice(-60).join('\n')}`)
    }
    t.notOk(await instance('p2'), 'P2 is gone from the topology')
    t.ok(Number.isFinite(run.releasedMs), 'D’s connector released P2’s NIXL state on the router’s peer_gone')
    t.match(D.tail(2000), new RegExp(`handoff: peer_gone ${p2Engine} \\(seq \\d+, drained`), 'and logged why')
    t.ok((ENGINE_TTL_S * 1000) / run.releasedMs >= 10, 'at least 10x sooner than stock vLLM')
    // The kubelet's SIGTERM, once the hook returned.
    await P2.stop()
  })
})
