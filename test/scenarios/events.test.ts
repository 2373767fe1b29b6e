import { freePort } from '../../common/ports.js'
import t, { type Test } from 'tap'
import type { SpawnedService } from '../../common/spawn.js'
import { get, post } from '../helpers/cluster.js'
import { complete, completionBody, metric, sleep, startEngine, startRouterProcess, tally, within, type Engine, type Outcome } from '../helpers/pd-agents.js'
import { needNixl, probeNixl } from '../native/helpers.js'

/*
 * Issue 9, scenarios with real processes (router, and simulators with their transfer agents,
 * each agent following the router's event log with --router-url):
 * a. ops `POST /fault_tolerance/event` peer_gone for the prefiller → every agent applies it
 *    within APPLY_BOUND_MS; the decoder's next pull from it fails fast (XFA_ERR_PEER_GONE); a
 *    repeat, an unknown engine, a bad body and a missing token change nothing.
 * b. the prefiller crashes (SIGKILL): its probes fail and its agent's stream is gone, so the
 *    router emits peer_gone for its engine_id, and the decoder's agent applies it within
 *    APPLY_BOUND_MS of the kill; it comes back at the same ports under a new engine_id and
 *    every later request succeeds.
 * c. the router restarts under traffic: agents register again and resume; its log is in
 *    memory and starts at 1 again, below what the agents applied, so they apply it from its
 *    start; an event logged after the restart reaches every agent.
 */

const LEASE_S = 10
const ADMIN = 'admin-token-0123'
const admin = { authorization: `Bearer ${ADMIN}` }
// Apply bound for one event: the stream is open, so this is one HTTP write and one ack.
const APPLY_BOUND_MS = 2000
const probe = await probeNixl()
const fastHealth = { health: { intervalMs: 100, timeoutMs: 500, unhealthyThreshold: 1, baseEjectionMs: 200, maxEjectionMs: 1000 } }

interface RouterLinkStatus {
  connected: boolean
  routerId: string | null
  lastApplied: number
  lastAcked: number
}

async function agentStatus(e: Engine): Promise<{ agentId: string; engineId: string | null; router: RouterLinkStatus }> {
  return (await get(`${e.agent.url}/v1/status`)).json()
}


async function cluster(t: Test, routerPort: number, agentUrls?: (routerUrl: string) => string) {
  const routerUrl = `http://127.0.0.1:${routerPort}`
  const agentArgs = ['--router-url', agentUrls ? agentUrls(routerUrl) : routerUrl]
  const prefill = await startEngine(t, { role: 'prefill', leaseSeconds: LEASE_S, agentArgs })
  const decode = await startEngine(t, { role: 'decode', leaseSeconds: LEASE_S, simArgs: ['--kv-load-failure-policy', 'fail'], agentArgs })
  const config = { port: routerPort, adminToken: ADMIN, ...fastHealth }
  const router = await startRouterProcess(t, [prefill, decode], config)
  const restart = async (): Promise<SpawnedService> => startRouterProcess(t, [prefill, decode], config)
  const connected = await within(10_000, async () => (await Promise.all([prefill, decode].map(agentStatus))).every((s) => s.router.connected))
  t.ok(connected >= 0, `both agents follow the router's log (${Math.round(connected)} ms after it started)`)
  return { prefill, decode, router, restart }
}

/** Whether every expected agent applied `seq` (GET /fault_tolerance/events/:seq). */
async function delivered(url: string, seq: number, agents: string[]): Promise<boolean> {
  const d = (await get(`${url}/fault_tolerance/events/${seq}`, admin)).json<{ applied: string[]; expected: string[] }>()
  return agents.every((a) => d.applied.includes(a) && d.expected.includes(a))
}

t.test('a. ops peer_gone: every agent applies it, the decoder fails fast, repeats and unknowns are no-ops', { skip: needNixl(t, probe) }, async (t) => {
  // The decoder's agent is given a dead router first: it fails over to the live one.
  const deadPort = await freePort()
  const { prefill, decode, router } = await cluster(t, await freePort(), (url) => `http://127.0.0.1:${deadPort},${url}`)
  const first = await complete(router.url, completionBody(0, 'a'), 0)
  t.ok(first.ok, `a request works before (${first.status} ${first.code ?? ''})`)
  const p = await agentStatus(prefill)
  const d = await agentStatus(decode)

  const url = `${router.url}/fault_tolerance/event`
  const event = { event_type: 'peer_gone', nodes: { engine_ids: [p.engineId] }, reason: 'scenario a' }
  let res = await post(url, event)
  t.equal(res.status, 401, 'no token: 401')
  t.equal(res.json<{ error: { code: string } }>().error.code, 'RTR_ERR_ADMIN_UNAUTHORIZED')
  res = await post(url, { event_type: 'peer_gone', nodes: { engine_ids: 'x' } }, admin)
  t.equal(res.status, 400, 'bad body: 400')
  res = await post(url, { event_type: 'peer_gone', nodes: { engine_ids: ['no-such-engine'] } }, admin)
  t.same(res.json(), { seq: null, engine_ids: [], unknown: ['no-such-engine'], logged: false }, 'unknown engine: a no-op')

  res = await post(url, event, admin)
  t.equal(res.status, 202)
  const { seq, logged } = res.json<{ seq: number; logged: boolean }>()
  t.ok(logged)
  const ms = await within(APPLY_BOUND_MS, () => delivered(router.url, seq, [p.agentId, d.agentId]))
  t.ok(ms >= 0, `every agent applied peer_gone #${seq} within ${APPLY_BOUND_MS} ms (took ${Math.round(ms)} ms)`)
  t.comment(`ops peer_gone → applied by both agents in ${Math.round(ms)} ms`)
  t.match((await get(`${router.url}/fault_tolerance/events/${seq}`, admin)).json(), { complete: true })
  t.ok((await metric(decode.agent.url, 'handoff_agent_router_events_total', { type: 'peer_gone' })) >= 1, "counted in the decoder agent's metrics")
  t.equal(await metric(decode.agent.url, 'handoff_agent_router_connected'), 1)

  res = await post(url, event, admin)
  t.same(res.json(), { seq, engine_ids: [p.engineId], unknown: [], logged: false }, 'a repeat: the same seq, nothing logged')

  // D's next pull naming P fails fast: the request fails with the agent's code in its message.
  const started = performance.now()
  const after = await complete(router.url, completionBody(1, 'a'), 1)
  const took = performance.now() - started
  t.not(after.status, 200, 'the request through the gone prefiller fails')
  t.match(after.message ?? '', /XFA_ERR_PEER_GONE/, `with XFA_ERR_PEER_GONE (${after.code}: ${after.message?.slice(0, 160)})`)
  t.ok(took < 5000, `and fast (${Math.round(took)} ms)`)
})

t.test('b. a prefiller crash: peer_gone for its old engine_id reaches the decoder agent', { skip: needNixl(t, probe) }, async (t) => {
  const { prefill, decode, router } = await cluster(t, await freePort())
  t.ok((await complete(router.url, completionBody(0, 'b'), 0)).ok, 'a request works before')
  const old = await agentStatus(prefill)
  const d = await agentStatus(decode)
  const appliedBefore = d.router.lastApplied

  // The crash itself is the signal: probes fail and the agent's stream is gone.
  await prefill.kill()
  const killedAt = performance.now()
  let seq = 0
  const ms = await within(APPLY_BOUND_MS, async () => {
    const s = (await agentStatus(decode)).router
    if (s.lastApplied <= appliedBefore) return false
    seq = s.lastApplied
    return true
  })
  const total = performance.now() - killedAt
  t.ok(ms >= 0, `the decoder's agent applied peer_gone within ${APPLY_BOUND_MS} ms of the kill (${Math.round(total)} ms; probes every 100 ms, threshold 1)`)
  t.comment(`prefiller crash (SIGKILL) → peer_gone applied by the decoder's agent ${Math.round(total)} ms later`)
  const delivery = (await get(`${router.url}/fault_tolerance/events/${seq}`, admin)).json<{ type: string; expected: string[]; applied: string[] }>()
  t.equal(delivery.type, 'peer_gone')
  t.same(delivery.expected, [d.agentId], 'expected: the live decoder agent only (the dead agent left the directory)')
  t.same(delivery.applied, [d.agentId])

  await prefill.startAgent()
  await prefill.startSim()
  const now = await agentStatus(prefill)
  t.not(now.engineId, old.engineId, 'the prefiller came back under a new engine_id')

  // The old engine_id is gone at the decoder; the new one at the same address is not.
  const ok = await within(15_000, async () => (await complete(router.url, completionBody(1, 'b'), 1)).ok)
  t.ok(ok >= 0, 'requests succeed through the restarted prefiller')
  const outcomes: Outcome[] = []
  for (let i = 2; i < 6; i++) outcomes.push(await complete(router.url, completionBody(i, 'b'), i))
  t.equal(tally(outcomes).ok, 4, 'every later request succeeds with the oracle text')
})

t.test('c. a router restart under traffic: agents register again, resume, and apply the new log from its start', { skip: needNixl(t, probe) }, async (t) => {
  const port = await freePort()
  const { prefill, decode, router, restart } = await cluster(t, port)
  const agents = [await agentStatus(prefill), await agentStatus(decode)]
  const ids = agents.map((a) => a.agentId)
  // Two events before the restart (about engines only the router knows: traffic is not hurt).
  for (const n of [1, 2]) {
    await post(`${router.url}/v1/agents`, { agentId: `ghost-${n}`, engineId: `ghost-engine-${n}`, role: 'prefill', agentUrl: `http://127.0.0.1:${deadPortBase + n}` })
    await post(`${router.url}/fault_tolerance/event`, { event_type: 'peer_gone', nodes: { engine_ids: [`ghost-engine-${n}`] } }, admin)
  }
  t.ok((await within(APPLY_BOUND_MS, () => delivered(router.url, 2, ids))) >= 0, 'both agents applied #1 and #2')
  const oldRouterId = (await agentStatus(decode)).router.routerId

  let running = true
  const outcomes: Outcome[] = []
  const loops = [0, 1].map(async (w) => {
    for (let i = w; running; i += 2) {
      outcomes.push(await complete(router.url, completionBody(i, 'c'), i, 20_000))
      await sleep(20)
    }
  })
  await sleep(500)
  const stopStarted = performance.now()
  await router.stop()
  t.ok(performance.now() - stopStarted < 3000, `the router stopped in ${Math.round(performance.now() - stopStarted)} ms with agent streams open`)
  await sleep(300)
  const router2 = await restart()
  t.equal(router2.url, router.url, 'the new router serves at the same URL')
  const back = await within(5000, async () => {
    const s = await Promise.all([prefill, decode].map(agentStatus))
    return s.every((x) => x.router.connected && x.router.routerId !== oldRouterId)
  })
  t.ok(back >= 0, `both agents registered with the new router and resumed (${Math.round(back)} ms after it was ready)`)
  for (const a of [prefill, decode]) t.equal((await agentStatus(a)).router.lastApplied, 0, 'the new log is applied from its start')
  await sleep(1000)
  running = false
  await Promise.all(loops)
  const c = tally(outcomes)
  t.comment(`traffic across the restart: ${c.requests} requests, ${c.ok} ok, ${c.failed} failed ${JSON.stringify(c.codes)}`)
  t.equal(c.wrong, 0, 'no wrong text')
  t.ok(outcomes.slice(-2).every((o) => o.ok), 'traffic flows again after the restart')

  await post(`${router2.url}/v1/agents`, { agentId: 'ghost-3', engineId: 'ghost-engine-3', role: 'prefill', agentUrl: `http://127.0.0.1:${deadPortBase + 3}` })
  const res = await post(`${router2.url}/fault_tolerance/event`, { event_type: 'peer_gone', nodes: { engine_ids: ['ghost-engine-3'] } }, admin)
  const { seq } = res.json<{ seq: number }>()
  t.equal(seq, 1, 'the new log starts at 1, below the 2 the agents had applied')
  const ms = await within(APPLY_BOUND_MS, () => delivered(router2.url, seq, ids))
  t.ok(ms >= 0, `every agent applied the event logged after the restart (${Math.round(ms)} ms)`)
  // What the old router knew is gone with it: a repeat of its events is unknown here.
  const repeat = await post(`${router2.url}/fault_tolerance/event`, { event_type: 'peer_gone', nodes: { engine_ids: ['ghost-engine-1'] } }, admin)
  t.same(repeat.json<{ unknown: string[] }>().unknown, ['ghost-engine-1'], 'the old log (and its gone set) did not survive the restart (in-memory store)')
})

// Ports nothing listens on: ghost agents are only names to the router, which never dials them.
const deadPortBase = 1
