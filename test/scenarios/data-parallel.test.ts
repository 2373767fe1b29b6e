import t, { type Test } from 'tap'
import { freePort } from '../../common/ports.js'
import { get, spawnRouter, startSim, type Teardown } from '../helpers/cluster.js'
import { admin, ADMIN, agentStatus, APPLY_BOUND_MS, LEASE_S } from '../helpers/event-log.js'
import { complete, completionBody, metric, startEngine, within, type Engine, type Outcome, type Tally } from '../helpers/pd-agents.js'
import { report } from '../helpers/stall.js'
import { roundRobinHop } from '../helpers/round-robin-hop.js'
import { needNixl, probeNixl } from '../native/helpers.js'

/*
 * Issue 37 item 3, with real processes: several live engines behind one URL. vLLM data
 * parallel names each rank's engine `<engine_id>_dp<rank>`; the router registered the URL as
 * one instance with one engine_id, and every answer from the other rank was an
 * `engine_id_changed`: peer_gone for a live engine, peer_alive when it answered again, and the
 * decoders' pulls from it failing with XFA_ERR_PEER_GONE in between.
 * a. `handoff sim --data-parallel-size 2` (--kv none): the ranks alternate behind one port.
 * b. Two ranks of an externally balanced deployment (`--data-parallel-rank`), each with its
 *    transfer agent, behind a round-robin hop: real pulls from both, then one rank restarts
 *    under a new engine_id: peer_gone for that rank alone.
 * c. The issue's own reproduction: two engines without a rank suffix (a Service over two
 *    pods) behind the hop. The second engine_id looks like the first restarting, but the
 *    first one's agent still streams events from the router: it is alive, nothing is declared
 *    gone (before: one peer_gone at the first alternation, lifted when it answered again, and
 *    the pulls in flight around it failed).
 */

const probe = await probeNixl()
const fastHealth = { health: { intervalMs: 100, timeoutMs: 500, unhealthyThreshold: 1, baseEjectionMs: 200, maxEjectionMs: 1000 } }

interface LoggedEvent {
  seq: number
  type: string
  engine_ids: string[]
}

/** Every event the router logged, read one by one through GET /fault_tolerance/events/:seq. */
async function routerEvents(url: string): Promise<LoggedEvent[]> {
  const { events } = (await get(`${url}/topology`, admin)).json<{ events: { first: number; last: number } }>()
  const out: LoggedEvent[] = []
  for (let seq = events.first; seq <= events.last; seq++) out.push((await get(`${url}/fault_tolerance/events/${seq}`, admin)).json<LoggedEvent>())
  return out
}

const ofType = (events: LoggedEvent[], type: string) => events.filter((e) => e.type === type).map((e) => e.engine_ids)

async function instanceEngineIds(url: string, id: string): Promise<string[]> {
  const topo = (await get(`${url}/topology`, admin)).json<{ instances: { id: string; engineIds?: string[]; engineId: string | null }[] }>()
  const i = topo.instances.find((x) => x.id === id)
  return [...(i?.engineIds ?? (i?.engineId ? [i.engineId] : []))].sort()
}

async function instanceSharedRanks(url: string, id: string): Promise<boolean> {
  const topo = (await get(`${url}/topology`, admin)).json<{ instances: { id: string; sharedRanks?: boolean }[] }>()
  return topo.instances.find((x) => x.id === id)?.sharedRanks === true
}

/** `workers` clients, `perWorker` requests each, one after another. */
async function traffic(url: string, workers: number, perWorker: number, tag: string): Promise<Outcome[]> {
  const out: Outcome[] = []
  await Promise.all(
    Array.from({ length: workers }, async (_, w) => {
      for (let k = 0; k < perWorker; k++) {
        const i = w * perWorker + k
        out.push(await complete(url, completionBody(i, tag), i, 30_000))
      }
    }),
  )
  return out
}

/** The tally line and `wrong text: N of M`. */
function counted(t: Test, name: string, outcomes: Outcome[]): Tally {
  const s = report(t, name, outcomes)
  t.comment(`wrong text: ${s.wrong} of ${s.requests}`)
  return s
}

t.test('a. --data-parallel-size 2 behind one port: both ranks live, nothing declared gone', async (t) => {
  const p = await startSim(t, ['--role', 'prefill', '--data-parallel-size', '2'])
  const d = await startSim(t, ['--role', 'decode'])
  const router = await spawnRouter(t, { adminToken: ADMIN, instances: [{ id: 'prefill-0', role: 'prefill', url: p.url }, { id: 'decode-0', role: 'decode', url: d.url }] })
  const outcomes = await traffic(router.url, 4, 10, 'dp')
  const s = counted(t, '--data-parallel-size 2, --kv none', outcomes)
  t.ok(s.requests >= 30)
  t.equal(s.wrong, 0, 'no wrong text')
  t.equal(s.ok, s.requests, 'every request answered with the oracle text')
  const events = await routerEvents(router.url)
  t.comment(`router events: ${ofType(events, 'peer_gone').length} peer_gone, ${ofType(events, 'peer_alive').length} peer_alive`)
  t.same(ofType(events, 'peer_gone'), [], 'no peer_gone for a live rank')
  const ranks = ((await get(`${p.url}/sim/info`)).json<{ engineIds: string[] }>()).engineIds
  t.same(await instanceEngineIds(router.url, 'prefill-0'), [...ranks].sort(), "the instance holds both ranks' engine_ids")
})

/** Two ranks with agents behind a round-robin hop, a fail-policy decoder, one router following them all. */
async function hopCluster(t: Teardown, prefillArgs: (rank: number) => string[]) {
  const routerPort = await freePort()
  const routerUrl = `http://127.0.0.1:${routerPort}`
  const agentArgs = ['--router-url', routerUrl]
  const ranks: Engine[] = []
  for (const r of [0, 1]) ranks.push(await startEngine(t, { role: 'prefill', leaseSeconds: LEASE_S, agentArgs, simArgs: prefillArgs(r) }))
  const decode = await startEngine(t, { role: 'decode', leaseSeconds: LEASE_S, simArgs: ['--kv-load-failure-policy', 'fail'], agentArgs })
  const hop = await roundRobinHop(t, ranks.map((e) => e.sim.url))
  const router = await spawnRouter(t, {
    port: routerPort,
    adminToken: ADMIN,
    ...fastHealth,
    instances: [
      { id: 'prefill-0', role: 'prefill', url: hop.url },
      { id: 'decode-0', role: 'decode', url: decode.sim.url },
    ],
  })
  const connected = await within(10_000, async () => (await Promise.all([...ranks, decode].map(agentStatus))).every((s) => s.router.connected))
  if (connected < 0) throw new Error('the agents did not connect to the router')
  return { ranks, decode, hop, router }
}

t.test('b. two data-parallel ranks with agents behind one URL; one rank restarts under a new engine_id', { skip: needNixl(t, probe) }, async (t) => {
  const { ranks, decode, hop, router } = await hopCluster(t, (r) => ['--data-parallel-size', '2', '--data-parallel-rank', String(r)])
  const before = await Promise.all(ranks.map(async (e) => (await agentStatus(e)).engineId as string))
  t.match(before, [/_dp0$/, /_dp1$/], 'each rank is named <engine_id>_dp<rank>')

  const live = await traffic(router.url, 4, 15, 'live')
  const s = counted(t, 'two ranks behind one URL', live)
  t.ok(s.requests >= 30)
  t.equal(s.wrong, 0, 'no wrong text')
  t.equal(s.ok, s.requests, 'every request answered with the oracle text')
  t.ok(hop.served.every((n) => n >= 10), `both ranks served prefills (${hop.served.join(', ')})`)
  let events = await routerEvents(router.url)
  t.comment(`router events: ${ofType(events, 'peer_gone').length} peer_gone, ${ofType(events, 'peer_alive').length} peer_alive`)
  t.same(ofType(events, 'peer_gone'), [], 'no peer_gone for a live rank')
  t.same(await instanceEngineIds(router.url, 'prefill-0'), [...before].sort(), 'the instance holds both ranks')

  // Rank 1 restarts (sim and agent) at the same ports under a new engine_id; the hop sends
  // everything to rank 0 meanwhile.
  const rank1 = ranks[1] as Engine
  await rank1.kill()
  await rank1.startAgent()
  await rank1.startSim()
  const restarted = performance.now()
  const fresh = (await agentStatus(rank1)).engineId as string
  t.not(fresh, before[1])
  t.match(fresh, /_dp1$/, 'the new incarnation of rank 1')
  const d0 = (await agentStatus(decode)).router.lastApplied

  // Traffic through the URL; the new rank 1 answering a prefill is what says the old one is gone.
  const running = traffic(router.url, 4, 10, 'restart')
  const applied = await within(APPLY_BOUND_MS + 10_000, async () => (await agentStatus(decode)).router.lastApplied > d0)
  t.comment(`rank 1 restarted → an event applied by the decoder's agent ${Math.round(performance.now() - restarted)} ms later (under traffic)`)
  const after = await running
  events = await routerEvents(router.url)
  const gone = events.filter((e) => e.type === 'peer_gone')
  t.same(gone.map((e) => e.engine_ids), [[before[1]]], 'peer_gone for the old rank 1 alone')
  t.ok(applied >= 0 && applied < APPLY_BOUND_MS, `applied within ${APPLY_BOUND_MS} ms of the restart (${Math.round(applied)} ms)`)
  t.equal(await metric(router.url, 'handoff_router_topology_changes_total', { type: 'engine_id_changed' }), 1, 'declared by the new engine_id under its rank (the hop kept the URL answering: no crash seen)')
  t.same(ofType(events, 'peer_alive'), [], 'no tombstone to lift: nothing live was declared gone')
  const r = counted(t, 'after rank 1 restarted', after)
  t.equal(r.wrong, 0, 'no wrong text')
  const later = await traffic(router.url, 4, 8, 'later')
  const l = counted(t, 'later', later)
  t.equal(l.ok, l.requests, 'every later request answered with the oracle text')
  t.same(await instanceEngineIds(router.url, 'prefill-0'), [before[0] as string, fresh].sort(), 'rank 0 and the new rank 1')
})

t.test('c. two engines without a rank suffix behind one URL (a Service over two pods)', { skip: needNixl(t, probe) }, async (t) => {
  const { hop, router } = await hopCluster(t, () => [])
  const outcomes = await traffic(router.url, 4, 15, 'svc')
  const s = counted(t, 'two suffix-less engines behind one URL', outcomes)
  const events = await routerEvents(router.url)
  const gone = ofType(events, 'peer_gone')
  const alive = ofType(events, 'peer_alive')
  t.comment(`router events: ${gone.length} peer_gone, ${alive.length} peer_alive`)
  t.ok(hop.served.every((n) => n >= 10), `both engines served prefills (${hop.served.join(', ')})`)
  t.equal(s.wrong, 0, 'no wrong text')
  t.same(gone, [], 'no peer_gone: both agents stream events, so neither engine restarted')
  t.same(alive, [], 'no tombstone to lift')
  t.equal(s.failed, 0, 'no request failed')
  t.ok(await instanceSharedRanks(router.url, 'prefill-0'), 'the URL is known to front several engines')
  const later = await traffic(router.url, 4, 8, 'svc-later')
  const l = counted(t, 'later', later)
  t.equal(l.ok, l.requests, 'then every request answered with the oracle text')
  t.same(ofType(await routerEvents(router.url), 'peer_gone'), gone, 'and nothing more declared gone')
})
