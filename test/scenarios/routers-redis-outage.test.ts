import t from 'tap'
import type { SpawnedService } from '../../common/spawn.js'
import { get, post } from '../helpers/cluster.js'
import { complete, completionBody, metric, within } from '../helpers/pd-agents.js'
import { admin, agentStatus, delivered, ghost } from '../helpers/event-log.js'
import { fleet } from '../helpers/routers.js'
import { needRedis } from '../helpers/redis.js'
import { needNixl, probeNixl } from '../native/helpers.js'

/*
 * Issue 10, several routers on one Redis, with real processes (test/helpers/routers.ts):
 * c. Redis stopped: both keep routing from their last topology, say `degraded` on /ready and
 * in metrics, refuse control writes with RTR_ERR_STORE_UNAVAILABLE; Redis back (empty):
 * both recover without a restart, agents start over on the new log, writes work again.
 */

const probe = await probeNixl()

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
