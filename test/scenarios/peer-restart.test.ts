import t from 'tap'
import { request } from 'undici'
import { probeNixl, needNixl } from '../native/helpers.js'
import { complete, completionBody, metric, sleep, startEngine, startRouterProcess, tally, type Outcome } from '../helpers/pd-agents.js'

/*
 * Issue #8, scenarios b and c: dead peers.
 * b. The prefiller (simulator and agent) is killed with SIGKILL under traffic and comes back
 *    at the same host:port under a new engine_id while the decoder stays up. Requests cut by
 *    the kill fail cleanly and none hangs; the decoder's agent releases the old peer once no
 *    READ uses it; every request after the restart succeeds with the oracle's text.
 * c. Only the prefiller's agent dies and restarts (same engine_id, the engine stays up and
 *    re-attaches): the decoder's cached handshake points at a dead NIXL endpoint, a READ finds
 *    the link disconnected, and the next pull re-handshakes and succeeds.
 */

const LEASE_S = 10
const probe = await probeNixl()
const fastHealth = { health: { intervalMs: 100, timeoutMs: 500, unhealthyThreshold: 1, baseEjectionMs: 200, maxEjectionMs: 1000 } }

/** `workers` clients sending one request after another until `stop()`. */
function traffic(url: string, workers: number, tag: string): { stop: () => Promise<Outcome[]> } {
  let running = true
  let n = 0
  const outcomes: Outcome[] = []
  const loops = Array.from({ length: workers }, async () => {
    while (running) {
      const i = n++
      outcomes.push(await complete(url, completionBody(i, tag), i, 30_000))
    }
  })
  return {
    stop: async () => {
      running = false
      await Promise.all(loops)
      return outcomes
    },
  }
}

async function untilOk(check: () => Promise<boolean>, timeoutMs: number): Promise<boolean> {
  const end = performance.now() + timeoutMs
  while (performance.now() < end) {
    // One check that hangs (a connection nobody answers) must not hold the loop past its bound.
    const bounded = Promise.race([check(), sleep(2000).then(() => false)])
    if (await bounded.catch(() => false)) return true
    await sleep(100)
  }
  return false
}

t.test('b. prefiller killed and restarted under a new engine_id at the same address', { skip: needNixl(t, probe) }, async (t) => {
  const prefill = await startEngine(t, { role: 'prefill', leaseSeconds: LEASE_S })
  const decode = await startEngine(t, { role: 'decode', leaseSeconds: LEASE_S, simArgs: ['--kv-load-failure-policy', 'fail'] })
  const router = await startRouterProcess(t, [prefill, decode], fastHealth)

  const before = traffic(router.url, 4, 'before')
  await sleep(1500)
  const oldSim = prefill.sim.url
  await prefill.kill()
  await sleep(300)
  await prefill.startAgent()
  await prefill.startSim()
  t.equal(prefill.sim.url, oldSim, 'the prefiller is back at the same address')
  const cut = await before.stop()
  const c = tally(cut)
  t.comment(`during the kill: ${c.requests} requests, ${c.ok} oracle text, ${c.wrong} wrong text, ${c.failed} failed ${JSON.stringify(c.codes)}`)
  t.equal(c.wrong, 0, 'no wrong text around the kill')
  t.equal(cut.filter((o) => o.status === 0).length, 0, 'every request got an answer (none hung or lost its connection)')
  t.ok(cut.every((o) => o.ms < 30_000), 'none waited past 30 s')

  // The router must see the prefiller up again before "later" requests start, and serve P/D
  // through it: the decode failures around the kill may have opened the pair's breaker, and
  // until its trial passes requests are served by D alone.
  const pulls = await metric(decode.agent.url, 'handoff_agent_pulls_total', { outcome: 'ok' })
  t.ok(
    await untilOk(async () => (await complete(router.url, completionBody(0, 'probe'), 0)).ok && (await metric(decode.agent.url, 'handoff_agent_pulls_total', { outcome: 'ok' })) > pulls, 30_000),
    'a request succeeds again, through the restarted prefiller',
  )
  const after = traffic(router.url, 4, 'after')
  await sleep(2000)
  const later = tally(await after.stop())
  t.comment(`after the restart: ${later.requests} requests, ${later.ok} oracle text, ${later.wrong} wrong text, ${later.failed} failed ${JSON.stringify(later.codes)}`)
  t.ok(later.requests > 0, 'traffic ran after the restart')
  t.equal(later.ok, later.requests, 'every later request succeeded with the oracle text')

  const releases = await metric(decode.agent.url, 'handoff_agent_peer_releases_total')
  t.ok(releases >= 1, `the decoder's agent released the old prefiller (${releases} release(s))`)
  t.ok(
    await untilOk(async () => (await metric(decode.agent.url, 'handoff_agent_peers', { state: 'releasing' })) === 0, 5000),
    'nothing is left releasing',
  )
  t.equal(await metric(decode.agent.url, 'handoff_agent_peers', { state: 'ready' }), 1, 'one peer cached: the new incarnation')
})

t.test('c. a remote disconnect on a live link: the next pull re-handshakes', { skip: needNixl(t, probe) }, async (t) => {
  const prefill = await startEngine(t, { role: 'prefill', leaseSeconds: LEASE_S })
  const decode = await startEngine(t, { role: 'decode', leaseSeconds: LEASE_S, simArgs: ['--kv-load-failure-policy', 'fail'] })
  const router = await startRouterProcess(t, [prefill, decode], fastHealth)

  const warm = await complete(router.url, completionBody(0, 'warm'), 0)
  t.ok(warm.ok, 'a first request succeeds (the handshake is cached)')
  const handshakes = await metric(decode.agent.url, 'handoff_agent_handshakes_total', { outcome: 'ok' })

  // Only the agent dies; the prefill engine stays up and attaches to the new agent.
  const engineId = ((await (await request(`${prefill.agent.url}/v1/status`)).body.json()) as { engineId: string }).engineId
  prefill.agent.child.kill('SIGKILL')
  await new Promise((resolve) => prefill.agent.child.once('exit', resolve))
  await prefill.startAgent()
  t.ok(
    await untilOk(async () => ((await (await request(`${prefill.agent.url}/v1/status`)).body.json()) as { engineId: string | null }).engineId === engineId, 10_000),
    'the engine re-attached to the new agent under the same engine_id',
  )

  // While its agent was away the engine reported itself unready and the router sent whole
  // requests to D; wait until it routes P/D again, so every request below is a real pull.
  t.ok(await untilOk(async () => (await request(`${prefill.sim.url}/health`)).statusCode === 200, 10_000), 'the prefill engine is ready again')
  await sleep(500)
  const pullsBefore = await metric(decode.agent.url, 'handoff_agent_pulls_total')
  const outcomes: Outcome[] = []
  for (let i = 1; i <= 12; i++) outcomes.push(await complete(router.url, completionBody(i, 'relink'), i))
  t.equal((await metric(decode.agent.url, 'handoff_agent_pulls_total')) - pullsBefore, 12, 'every request was a pull through the agents')
  const s = tally(outcomes)
  t.comment(`after the agent restart: ${s.requests} requests, ${s.ok} oracle text, ${s.wrong} wrong text, ${s.failed} failed ${JSON.stringify(s.codes)}`)
  for (const o of outcomes.filter((o) => o.status !== 200)) t.comment(`request ${o.i}: ${o.code}: ${o.message}`)
  t.equal(s.wrong, 0, 'no wrong text')
  t.ok(s.failed <= 1, 'at most the pull that found the dead link failed')
  t.ok(outcomes.slice(-10).every((o) => o.ok), 'every pull after it succeeded')
  t.ok((await metric(decode.agent.url, 'handoff_agent_handshakes_total', { outcome: 'ok' })) > handshakes, 'the decoder re-handshook')
})
