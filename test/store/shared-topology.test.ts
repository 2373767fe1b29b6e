import t from 'tap'
import type { TopologyRegistry } from '../../router/src/topology/registry.js'
import { type Teardown, waitFor } from '../helpers/cluster.js'
import { needRedis } from '../helpers/redis.js'
import { sharedRouters } from '../helpers/shared-routers.js'

/*
 * Issue 10: two routers' registries and agent directories kept in step through one real
 * Redis (router/src/store/shared-topology.ts), in process so each step can be looked at:
 * runtime instances, draining, engine_ids, the leader's verdicts (fenced), agents, removals
 * (tombstones), stream presence, and a resync after Redis came back empty.
 */

const config = [{ id: 'p0', role: 'prefill' as const, url: 'http://127.0.0.1:1001' }]
const setup = (t: Teardown) => sharedRouters(t, { prefix: 'st:', instances: config })

const view = (r: TopologyRegistry, id: string) => r.snapshot().instances.find((i) => i.id === id)

t.test('two routers on one Redis', { skip: needRedis(t) }, async (t) => {
  t.test('instances, draining, engine_ids and removals reach the other router; a late joiner gets them all', async (t) => {
    const { router } = await setup(t)
    const a = await router('a')
    const b = await router('b')
    const kvEvents = { endpoint: 'tcp://127.0.0.1:5557', replayEndpoint: 'tcp://127.0.0.1:5558' }
    a.registry.add({ id: 'd1', role: 'decode', url: 'http://127.0.0.1:2001', labels: { zone: 'x' }, kvEvents }, 'admin')
    t.ok(await waitFor(() => b.registry.has('d1')), 'added on a, present on b')
    t.match(view(b.registry, 'd1'), { source: 'admin', labels: { zone: 'x' }, role: 'decode' })
    t.same(b.registry.describe('d1')?.kvEvents, kvEvents, 'with where its KV events come from: b follows them too')

    a.registry.observeEngineId('p0', 'eng-1')
    t.ok(await waitFor(() => view(b.registry, 'p0')?.engineId === 'eng-1'), "a config instance's engine_id learned on a reaches b")
    b.registry.drain('d1')
    t.ok(await waitFor(() => view(a.registry, 'd1')?.draining === true), 'drained on b: draining on a')

    const c = await router('c')
    t.ok(c.registry.has('d1') && view(c.registry, 'd1')?.draining && view(c.registry, 'p0')?.engineId === 'eng-1', 'a router joining later reads everything at start')

    a.registry.remove('d1')
    t.ok(await waitFor(() => !b.registry.has('d1') && !c.registry.has('d1')), 'removed on a: gone everywhere')
    const d = await router('d')
    t.notOk(d.registry.has('d1'), 'the tombstone keeps a later joiner from bringing it back')
  })

  t.test('an instance\'s set of engine_ids reaches the other router, and so does a URL found to front several engines per rank (issue 37 item 3)', async (t) => {
    const { router } = await setup(t)
    const a = await router('a')
    const b = await router('b')
    const ids = (r: TopologyRegistry) => [...(view(r, 'p0')?.engineIds ?? [])].sort()
    const replaced: string[] = []
    b.registry.subscribe((c) => c.type === 'engine_id_changed' && replaced.push(c.previous))
    for (const e of ['X_dp0', 'X_dp1', 'X_dp0']) a.registry.observeEngineId('p0', e)
    t.ok(await waitFor(() => ids(b.registry).join() === 'X_dp0,X_dp1'), "both ranks learned on a are b's too")
    a.registry.observeEngineId('p0', 'Y_dp1')
    t.ok(await waitFor(() => ids(b.registry).join() === 'X_dp0,Y_dp1'), 'a replaced rank 1: so does b')
    t.same(replaced, ['X_dp1'], 'for rank 1 alone')
    // Rank 0 turns out to be two engines (two pods behind the URL): found on a.
    for (const e of ['Z_dp0', 'X_dp0']) a.registry.observeEngineId('p0', e)
    t.ok(await waitFor(() => view(b.registry, 'p0')?.sharedRanks === true), 'b knows the URL fronts several engines per rank')
    t.ok(await waitFor(() => ids(b.registry).join() === 'X_dp0,Y_dp1,Z_dp0'))
    b.registry.observeEngineId('p0', 'W_dp1')
    t.same(ids(b.registry), ['W_dp1', 'X_dp0', 'Y_dp1', 'Z_dp0'], 'and replaces nothing there either')
    // a's one wrong replacement (Z_dp0 for X_dp0) b follows or not, as it reads a's row before or after the proof.
    t.same(replaced.filter((e) => e !== 'X_dp0'), ['X_dp1'], 'nothing replaced after it')
  })

  t.test("only the prober leader's verdicts are shared, and they apply without a threshold", async (t) => {
    const { router } = await setup(t)
    const a = await router('a')
    const b = await router('b')
    const [leader, follower] = a.leader.isLeader ? [a, b] : [b, a]
    t.ok(leader.leader.isLeader && !follower.leader.isLeader, 'one of them leads')
    leader.registry.recordProbe('p0', true, ['m1'])
    leader.registry.recordProbe('p0', false)
    t.ok(await waitFor(() => view(follower.registry, 'p0')?.healthy === false), "the leader's down verdict reaches the follower")
    follower.registry.recordProbe('p0', true, ['m2'])
    await new Promise((resolve) => setTimeout(resolve, 200))
    t.equal(view(leader.registry, 'p0')?.healthy, false, "a follower's own probe is not shared")
    leader.registry.recordProbe('p0', true, ['m1'])
    t.ok(await waitFor(() => view(follower.registry, 'p0')?.healthy === true && view(follower.registry, 'p0')?.models?.has('m1') === true), "up again, with the leader's models")
  })

  t.test('agents: registrations, removals and which router holds each stream', async (t) => {
    const { router, alive } = await setup(t)
    const a = await router('a')
    const b = await router('b')
    a.agents.register({ agentId: 'ag1', engineId: 'e1', role: 'prefill', agentUrl: 'http://127.0.0.1:3001', engineUrl: 'http://127.0.0.1:1001' }, 'p0')
    t.ok(await waitFor(() => b.agents.get('ag1')?.engineId === 'e1'), 'registered on a, known on b')
    t.equal(b.agents.get('ag1')?.instanceId, 'p0')
    t.equal(await b.shared.anyOpen(['ag1']), false, 'no stream anywhere')
    a.agents.streamOpened('ag1')
    a.shared.opened('ag1')
    t.ok(await waitFor(() => b.shared.anyOpen(['ag1'])), "b sees a's stream")
    alive.delete('a')
    t.equal(await b.shared.anyOpen(['ag1']), false, 'a stream held by a router that is gone does not count')
    alive.add('a')
    a.agents.streamClosed('ag1')
    a.shared.closed('ag1')
    t.ok(await waitFor(async () => !(await b.shared.anyOpen(['ag1']))), 'closed')
    a.agents.remove('ag1')
    t.ok(await waitFor(() => b.agents.get('ag1') === undefined), 'removed on a, gone on b')
  })

  t.test('Redis restarted empty: what each router holds is written back, and changes flow again', async (t) => {
    const { server, router } = await setup(t)
    const a = await router('a')
    const b = await router('b')
    a.registry.add({ id: 'd1', role: 'decode', url: 'http://127.0.0.1:2001' }, 'admin')
    a.agents.register({ agentId: 'ag1', engineId: 'e1', role: 'decode', agentUrl: 'http://127.0.0.1:3001' }, undefined)
    t.ok(await waitFor(() => b.registry.has('d1') && b.agents.get('ag1') !== undefined))
    await server.stop()
    // Learned while Redis is away: kept, and written first when it is back.
    b.registry.observeEngineId('d1', 'eng-d1')
    await server.start()
    t.ok(await waitFor(() => view(a.registry, 'd1')?.engineId === 'eng-d1', 10_000), "b's engine_id learned during the outage reaches a after the resync")
    const late = await router('late')
    t.ok(late.registry.has('d1') && late.agents.get('ag1') !== undefined, 'the empty Redis got the topology back from the routers')
    a.registry.add({ id: 'd2', role: 'decode', url: 'http://127.0.0.1:2002' }, 'admin')
    t.ok(await waitFor(() => b.registry.has('d2') && late.registry.has('d2')), 'and changes flow again')
  })
})
