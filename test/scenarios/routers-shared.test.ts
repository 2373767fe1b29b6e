import t from 'tap'
import type { SpawnedService } from '../../common/spawn.js'
import { get, post } from '../helpers/cluster.js'
import { complete, completionBody, metric, within, startEngine } from '../helpers/pd-agents.js'
import { admin, agentStatus, delivered, ghost, LEASE_S } from '../helpers/event-log.js'
import { fleet } from '../helpers/routers.js'
import { needRedis } from '../helpers/redis.js'
import { needNixl, probeNixl } from '../native/helpers.js'

/*
 * Issue 10, several routers on one Redis, with real processes (test/helpers/routers.ts):
 * a. they share one topology, one event log and one prober: an instance added on one is
 * routed to by the other; an ops peer_gone on one reaches an agent streaming from the
 * other; exactly one of them probes.
 */

const probe = await probeNixl()

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
