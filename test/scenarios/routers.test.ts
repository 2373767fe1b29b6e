import t, { type Test } from 'tap'
import { freePort } from '../../common/ports.js'
import type { SpawnedService } from '../../common/spawn.js'
import { get, post } from '../helpers/cluster.js'
import { complete, completionBody, metric, sleep, startEngine, startRouterProcess, tally, within, type Engine, type Outcome } from '../helpers/pd-agents.js'
import { needRedis, startRedis, type LocalRedis } from '../helpers/redis.js'
import { needNixl, probeNixl } from '../native/helpers.js'

/*
 * Issue 10, several routers on one Redis, with real processes (two router processes, a real
 * redis-server, simulators with their transfer agents; every agent knows both routers):
 * a. they share one topology, one event log and one prober: an instance added on one is
 *    routed to by the other; an ops peer_gone on one reaches an agent streaming from the
 *    other; exactly one of them probes.
 * b. a router SIGKILLed under load: its requests fail cleanly (none hangs), the other keeps
 *    answering, its agents resume on the other router after their last sequence, and an
 *    event logged while they were away reaches them.
 * c. Redis stopped: both keep routing from their last topology, say `degraded` on /ready and
 *    in metrics, refuse control writes with RTR_ERR_STORE_UNAVAILABLE; Redis back (empty):
 *    both recover without a restart, agents start over on the new log, writes work again.
 */

const LEASE_S = 10
const ADMIN = 'admin-token-0123'
const admin = { authorization: `Bearer ${ADMIN}` }
const probe = await probeNixl()
const fastHealth = { health: { intervalMs: 100, timeoutMs: 500, unhealthyThreshold: 2, baseEjectionMs: 200, maxEjectionMs: 1000 } }

interface Status {
  agentId: string
  engineId: string | null
  router: { connected: boolean; routerId: string | null; lastApplied: number; lastAcked: number }
}

const agentStatus = async (e: Engine): Promise<Status> => (await get(`${e.agent.url}/v1/status`)).json()


interface Fleet {
  redis: LocalRedis
  prefill: Engine
  decode: Engine
  routers: SpawnedService[]
}

/** Two routers on one Redis; agents list `order` of them (indexes) in their --router-url. */
async function fleet(t: Test, order: [number, number] = [0, 1]): Promise<Fleet> {
  const redis = await startRedis(t)
  const ports = [await freePort(), await freePort()]
  const urls = ports.map((p) => `http://127.0.0.1:${p}`)
  const agentArgs = ['--router-url', order.map((i) => urls[i]).join(',')]
  const prefill = await startEngine(t, { role: 'prefill', leaseSeconds: LEASE_S, agentArgs })
  const decode = await startEngine(t, { role: 'decode', leaseSeconds: LEASE_S, simArgs: ['--kv-load-failure-policy', 'fail'], agentArgs })
  const store = { kind: 'redis', url: redis.url, memberTtlMs: 900 }
  const routers = []
  for (const port of ports) routers.push(await startRouterProcess(t, [prefill, decode], { port, adminToken: ADMIN, store, ...fastHealth }))
  const ms = await within(10_000, async () => (await Promise.all([prefill, decode].map(agentStatus))).every((s) => s.router.connected))
  t.ok(ms >= 0, `both agents follow the shared log (${Math.round(ms)} ms after the routers started)`)
  return { redis, prefill, decode, routers }
}

async function delivered(url: string, seq: number, agents: string[]): Promise<boolean> {
  const d = (await get(`${url}/fault_tolerance/events/${seq}`, admin)).json<{ applied: string[]; expected: string[] }>()
  return agents.every((a) => d.applied.includes(a) && d.expected.includes(a))
}

/** A throwaway engine to declare gone: an agent registration nobody streams for. */
async function ghost(url: string, name: string, port: number): Promise<void> {
  const res = await post(`${url}/v1/agents`, { agentId: `ghost-${name}`, engineId: `ghost-${name}`, role: 'prefill', agentUrl: `http://127.0.0.1:${port}` })
  if (res.status !== 200) throw new Error(`ghost registration: ${res.status} ${res.text}`)
}

t.test('a. two routers share the topology, the event log and one prober', { skip: needRedis(t) || needNixl(t, probe) }, async (t) => {
  // The prefiller's agent streams from router 0, the decoder's from router 1.
  const { prefill, decode, routers } = await fleet(t)
  const [a, b] = routers as [SpawnedService, SpawnedService]
  const p = await agentStatus(prefill)
  const d = await agentStatus(decode)
  t.equal(p.router.routerId, d.router.routerId, 'one log id, whichever router an agent follows')
  for (const [i, r] of routers.entries()) {
    const out = await complete(r.url, completionBody(i, 'shared'), i)
    t.ok(out.ok, `router ${i} serves a P/D request (${out.status} ${out.code ?? ''})`)
  }

  const leaders = (await Promise.all(routers.map((r) => metric(r.url, 'handoff_router_prober_leader')))).reduce((x, y) => x + y, 0)
  t.equal(leaders, 1, 'exactly one router probes')

  // Added on router 0 (an autoscaler's call), routed to by router 1.
  const extra = await startEngine(t, { role: 'decode', leaseSeconds: LEASE_S, simArgs: ['--kv-load-failure-policy', 'fail'], agentArgs: ['--router-url', `${a.url},${b.url}`] })
  const added = await post(`${a.url}/admin/instances`, { id: 'decode-extra', role: 'decode', url: extra.sim.url }, admin)
  t.equal(added.status, 201, `POST /admin/instances on router 0: ${added.text}`)
  const seen = await within(2000, async () => (await get(`${b.url}/topology`, admin)).json<{ instances: { id: string; source: string }[] }>().instances.some((i) => i.id === 'decode-extra' && i.source === 'admin'))
  t.ok(seen >= 0, `router 1 has it ${Math.round(seen)} ms later`)

  // An ops peer_gone on router 1 reaches the prefiller's agent, which streams from router 0.
  await ghost(b.url, 'a', 41001)
  const ft = await post(`${b.url}/fault_tolerance/event`, { event_type: 'peer_gone', nodes: { engine_ids: ['ghost-a'] }, reason: 'test' }, admin)
  t.equal(ft.status, 202)
  const seq = ft.json<{ seq: number }>().seq
  const ms = await within(3000, () => delivered(a.url, seq, [p.agentId, d.agentId]))
  t.ok(ms >= 0, `every agent applied seq ${seq} (${Math.round(ms)} ms), as router 0 reports it`)
  const repeat = await post(`${a.url}/fault_tolerance/event`, { event_type: 'peer_gone', nodes: { engine_ids: ['ghost-a'] } }, admin)
  t.match(repeat.json(), { seq, logged: false }, 'the same event on the other router is a repeat of the shared one')
})

t.test('b. a router SIGKILLed under load: clean failures, the other serves, agents resume with nothing lost', { skip: needRedis(t) || needNixl(t, probe) }, async (t) => {
  // Both agents stream from router 0, the one that dies.
  const { prefill, decode, routers } = await fleet(t, [0, 1])
  const [a, b] = routers as [SpawnedService, SpawnedService]
  const before = await Promise.all([prefill, decode].map(agentStatus))
  const logId = before[0]?.router.routerId

  let stop = false
  const onA: Outcome[] = []
  const onB: Outcome[] = []
  const afterKill: { startedAt: number; out: Outcome }[] = []
  let killedAt = Number.POSITIVE_INFINITY
  const client = async (url: string, sink: Outcome[], n: number): Promise<void> => {
    for (let i = 0; !stop; i++) {
      const startedAt = performance.now()
      const out = await complete(url, completionBody(n * 1000 + i, 'kill', 8), n * 1000 + i, 20_000)
      sink.push(out)
      if (url === b.url && startedAt > killedAt) afterKill.push({ startedAt: startedAt - killedAt, out })
      if (!out.ok) await sleep(50)
    }
  }
  const clients = [0, 1, 2].map((n) => client(a.url, onA, n)).concat([3, 4].map((n) => client(b.url, onB, n)))
  await sleep(1500)
  // A router replica crashes: its requests in flight die with it.
  a.child.kill('SIGKILL')
  killedAt = performance.now()
  // Logged while the agents are between routers: they must still get it.
  await ghost(b.url, 'b', 41002)
  const ft = await post(`${b.url}/fault_tolerance/event`, { event_type: 'peer_gone', nodes: { engine_ids: ['ghost-b'] } }, admin)
  t.equal(ft.status, 202, 'the survivor takes control writes')
  const seq = ft.json<{ seq: number }>().seq
  await sleep(2500)
  stop = true
  await Promise.all(clients)

  const ta = tally(onA)
  const tb = tally(onB)
  t.comment(`router 0 (killed): ${JSON.stringify(ta)}; router 1: ${JSON.stringify(tb)}`)
  t.equal(tb.wrong, 0, 'router 1: no wrong text')
  t.equal(ta.wrong, 0, 'router 0: no wrong text')
  t.ok(onA.every((o) => o.ok || o.status === 0 || o.status >= 500), "router 0's failures are connection errors or coded 5xx, and none hung (each bounded)")
  const late = afterKill.filter((x) => x.startedAt <= 2000)
  t.ok(late.length > 0 && late.every((x) => x.out.ok), `requests to router 1 started in the 2 s after the kill succeed (${late.filter((x) => x.out.ok).length}/${late.length})`)

  const agents = [prefill, decode]
  const resumed = await within(10_000, async () => (await Promise.all(agents.map(agentStatus))).every((s) => s.router.connected && s.router.lastApplied >= seq))
  t.ok(resumed >= 0, `both agents resumed on router 1 and applied seq ${seq} logged while they were away (${Math.round(resumed)} ms after the load)`)
  const after = await Promise.all(agents.map(agentStatus))
  t.ok(
    after.every((s, i) => s.router.routerId === logId && s.router.lastApplied >= (before[i]?.router.lastApplied ?? 0)),
    'the same log: they resumed after their last sequence instead of starting over',
  )
  t.ok(await within(3000, () => delivered(b.url, seq, after.map((s) => s.agentId))) >= 0, 'router 1 records both acknowledgements')
  const out = await complete(b.url, completionBody(9999, 'after'), 9999)
  t.ok(out.ok, 'and P/D requests through router 1 still work')
})

t.test('c. Redis stopped and restarted empty: routing goes on, writes are refused, then everything recovers', { skip: needRedis(t) || needNixl(t, probe) }, async (t) => {
  const { redis, prefill, decode, routers } = await fleet(t)
  const [a, b] = routers as [SpawnedService, SpawnedService]
  const logId = (await agentStatus(prefill)).router.routerId

  await redis.stop()
  const degraded = await within(5000, async () => {
    const states = await Promise.all(routers.map(async (r) => (await get(`${r.url}/ready`)).json<{ store?: { state: string } }>().store?.state))
    return states.every((s) => s === 'degraded')
  })
  t.ok(degraded >= 0, `both routers report degraded on /ready (${Math.round(degraded)} ms)`)
  for (const r of routers) t.equal((await get(`${r.url}/ready`)).status, 200, 'and stay ready: they can route')
  t.equal(await metric(a.url, 'handoff_router_store_up'), 0, 'handoff_router_store_up 0')
  const outs = await Promise.all([0, 1, 2, 3].map((i) => complete(routers[i % 2]!.url, completionBody(i, 'outage'), i)))
  t.ok(
    outs.every((o) => o.ok),
    `P/D requests through both routers work from the last topology (${outs.map((o) => o.status).join(',')})`,
  )
  const refused = await post(`${a.url}/admin/instances`, { id: 'x', role: 'decode', url: 'http://127.0.0.1:9' }, admin)
  t.equal(refused.status, 503)
  t.equal(refused.json<{ error: { code: string } }>().error.code, 'RTR_ERR_STORE_UNAVAILABLE')
  t.equal(refused.headers['retry-after'], '1')
  const ops = await post(`${b.url}/fault_tolerance/event`, { event_type: 'peer_gone', nodes: { engine_ids: ['nobody'] } }, admin)
  t.equal(ops.json<{ error: { code: string } }>().error.code, 'RTR_ERR_STORE_UNAVAILABLE', 'ops events too')
  t.equal((await get(`${a.url}/topology`, admin)).status, 200, 'reads still answer')

  // Back, empty: a new log; every router recovers by itself.
  await redis.start()
  const ok = await within(10_000, async () => {
    const states = await Promise.all(routers.map(async (r) => (await get(`${r.url}/ready`)).json<{ store?: { state: string } }>().store?.state))
    return states.every((s) => s === 'ok')
  })
  t.ok(ok >= 0, `both routers are back to ok without a restart (${Math.round(ok)} ms)`)
  const startedOver = await within(10_000, async () => {
    const s = await Promise.all([prefill, decode].map(agentStatus))
    return s.every((x) => x.router.connected && x.router.routerId !== null && x.router.routerId !== logId)
  })
  t.ok(startedOver >= 0, `agents follow the new log (${Math.round(startedOver)} ms)`)
  const added = await post(`${a.url}/admin/instances`, { id: 'late', role: 'decode', url: decode.sim.url }, admin)
  t.equal(added.status, 201, `control writes work again (${added.text})`)
  t.ok(await within(3000, async () => (await get(`${b.url}/topology`, admin)).json<{ instances: { id: string }[] }>().instances.some((i) => i.id === 'late')) >= 0, 'and reach the other router')
  t.ok(
    await within(3000, async () => (await get(`${b.url}/topology`, admin)).json<{ instances: { id: string }[] }>().instances.some((i) => i.id === 'prefill-0')),
    'the topology from before is still there (republished into the empty Redis)',
  )
  await ghost(b.url, 'c', 41003)
  const ft = await post(`${b.url}/fault_tolerance/event`, { event_type: 'peer_gone', nodes: { engine_ids: ['ghost-c'] } }, admin)
  t.equal(ft.status, 202)
  const ids = await Promise.all([prefill, decode].map(async (e) => (await agentStatus(e)).agentId))
  t.ok((await within(5000, () => delivered(a.url, ft.json<{ seq: number }>().seq, ids))) >= 0, 'an event on the new log reaches both agents')
  const out = await complete(a.url, completionBody(777, 'back'), 777)
  t.ok(out.ok, 'P/D requests work')
})
