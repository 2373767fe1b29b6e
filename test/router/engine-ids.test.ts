import t from 'tap'
import { ManualClock } from '../../common/clock.js'
import { AgentDirectory } from '../../router/src/events/agent-directory.js'
import { RouterEvents } from '../../router/src/events/router-events.js'
import { MemoryLeaseLedger } from '../../router/src/leases/memory-ledger.js'
import { MemoryEventStore } from '../../router/src/store/event-store.js'
import { Drainer } from '../../router/src/topology/drainer.js'
import { TopologyRegistry, type TopologyChange } from '../../router/src/topology/registry.js'
import { waitFor } from '../helpers/cluster.js'

/*
 * Issue 37 item 3: one URL may front several live engines (vLLM data parallel names each rank
 * `<engine_id>_dp<rank>`; a Service over several pods). An instance holds a set of engine_ids;
 * another engine_id answering at the URL is not a death. A new engine_id replaces one only
 * under the same rank (no suffix: rank 0), and not at all at a URL that proved to front
 * several engines of one rank (a replaced engine_id answered again there).
 */

const policy = { unhealthyThreshold: 2, baseEjectionMs: 1000, maxEjectionMs: 3000 }

function registry(opts: { maxEngineIds?: number; engineIdTtlMs?: number } = {}) {
  const clock = new ManualClock()
  const urls = { p: 'http://127.0.0.1:1001', d: 'http://127.0.0.1:1002' }
  const reg = new TopologyRegistry({ clock, policy, instances: Object.entries(urls).map(([id, url]) => ({ id, role: 'prefill' as const, url })), ...opts })
  const changes: TopologyChange[] = []
  reg.subscribe((c) => changes.push(c))
  const ids = (id = 'p') => [...(reg.snapshot().instances.find((i) => i.id === id)?.engineIds ?? [])].sort()
  const replaced = () => changes.filter((c) => c.type === 'engine_id_changed').map((c) => (c.type === 'engine_id_changed' ? `${c.previous}->${c.current}` : ''))
  return { clock, reg, changes, ids, replaced }
}

t.test('data-parallel ranks behind one URL are all live: alternating answers replace nothing', async (t) => {
  const { reg, ids, replaced } = registry()
  for (let i = 0; i < 100; i++) t.equal(reg.observeEngineId('p', `X_dp${i % 2}`), undefined)
  t.same(ids(), ['X_dp0', 'X_dp1'], 'both ranks are in the set')
  t.same(replaced(), [], 'no engine_id_changed')
  t.equal(reg.snapshot().instances.find((i) => i.id === 'p')?.engineId, 'X_dp1', 'engineId: the one added last')
})

t.test('a new engine_id under the same rank replaces that rank alone', async (t) => {
  const { reg, ids, replaced } = registry()
  for (const e of ['X_dp0', 'X_dp1', 'X_dp2']) reg.observeEngineId('p', e)
  t.same(reg.observeEngineId('p', 'Y_dp1'), { instanceId: 'p', address: '127.0.0.1:1001', previous: 'X_dp1', current: 'Y_dp1' })
  t.same(ids(), ['X_dp0', 'X_dp2', 'Y_dp1'])
  for (let i = 0; i < 30; i++) reg.observeEngineId('p', ['X_dp0', 'Y_dp1', 'X_dp2'][i % 3] as string)
  t.same(replaced(), ['X_dp1->Y_dp1'], 'one change, for rank 1')
  // The whole server restarted: a new base id for every rank.
  for (const e of ['Z_dp0', 'Z_dp1', 'Z_dp2']) reg.observeEngineId('p', e)
  t.same(replaced(), ['X_dp1->Y_dp1', 'X_dp0->Z_dp0', 'Y_dp1->Z_dp1', 'X_dp2->Z_dp2'])
  t.same(ids(), ['Z_dp0', 'Z_dp1', 'Z_dp2'])
})

t.test('one engine without a suffix is rank 0: its restart under a new engine_id still replaces it', async (t) => {
  const { reg, ids, replaced } = registry()
  reg.observeEngineId('p', 'e1')
  t.same(reg.observeEngineId('p', 'e2'), { instanceId: 'p', address: '127.0.0.1:1001', previous: 'e1', current: 'e2' })
  reg.observeEngineId('p', 'e3')
  t.same(ids(), ['e3'])
  // Restarted with data parallel on: rank 0 is the old single engine's rank.
  reg.observeEngineId('p', 'F_dp0')
  reg.observeEngineId('p', 'F_dp1')
  t.same(replaced(), ['e1->e2', 'e2->e3', 'e3->F_dp0'])
  t.same(ids(), ['F_dp0', 'F_dp1'])
})

t.test('a replaced engine_id that answers again proves several engines share the rank: the URL stops replacing', async (t) => {
  const { reg, ids, replaced, changes } = registry()
  reg.observeEngineId('p', 'A')
  reg.observeEngineId('p', 'B')
  t.same(replaced(), ['A->B'], 'two pods behind a Service look like a restart at first')
  t.equal(reg.observeEngineId('p', 'A'), undefined, 'A answered again: it was never gone')
  t.same(ids(), ['A', 'B'], 'both are live')
  t.equal(reg.describe('p')?.sharedRanks, true, 'the instance is marked as fronting several engines per rank')
  for (let i = 0; i < 100; i++) reg.observeEngineId('p', ['A', 'B', 'C'][i % 3] as string)
  t.same(replaced(), ['A->B'], 'no later alternation, nor a third pod, is a replacement')
  t.same(ids(), ['A', 'B', 'C'])
  t.match(changes.at(-1), { type: 'engine_id_learned', instanceId: 'p', engineId: 'C' })
})

t.test('an engine_id whose agent streams events is alive: another one at its URL does not replace it', async (t) => {
  const clock = new ManualClock()
  const agents = new AgentDirectory({ clock })
  const reg = new TopologyRegistry({ clock, policy, instances: [{ id: 'p', role: 'prefill', url: 'http://127.0.0.1:1001' }], engineLive: (e) => agents.streamOpenFor(e) })
  const changes: TopologyChange[] = []
  reg.subscribe((c) => changes.push(c))
  const register = (agentId: string, engineId: string, port: number) =>
    agents.register({ agentId, engineId, role: 'prefill', agentUrl: `http://127.0.0.1:${port}`, engineUrl: 'http://127.0.0.1:1001' }, 'p')
  register('a', 'A', 2001)
  register('b', 'B', 2002)
  agents.streamOpened('a')
  agents.streamOpened('b')
  // Two pods behind one Service, both agents connected: the first alternation is no restart.
  for (let i = 0; i < 10; i++) reg.observeEngineId('p', i % 2 ? 'B' : 'A')
  t.same(changes.filter((c) => c.type === 'engine_id_changed'), [], 'nothing replaced')
  const view = reg.snapshot().instances[0]!
  t.same([...view.engineIds].sort(), ['A', 'B'])
  t.ok(view.sharedRanks, 'the URL fronts several engines per rank')
  // Without an open stream (a stock engine, or an agent gone) a new engine_id still replaces.
  const fresh = new TopologyRegistry({ clock, policy, instances: [{ id: 'q', role: 'prefill', url: 'http://127.0.0.1:1003' }], engineLive: (e) => agents.streamOpenFor(e) })
  register('c', 'C', 2003)
  fresh.observeEngineId('q', 'C')
  t.match(fresh.observeEngineId('q', 'D'), { previous: 'C', current: 'D' }, 'C has no open stream: its restart is D')
  agents.streamClosed('a')
  t.notOk(agents.streamOpenFor('A'), 'a closed stream is not alive, whatever the trust window')
})

t.test('the set is bounded without declaring anything gone: a cap, and a TTL where nothing replaces', async (t) => {
  const { clock, reg, ids, replaced } = registry({ maxEngineIds: 4, engineIdTtlMs: 60_000 })
  for (let r = 0; r < 6; r++) reg.observeEngineId('p', `X_dp${r}`)
  t.same(ids(), ['X_dp2', 'X_dp3', 'X_dp4', 'X_dp5'], 'past the cap the least recently seen are forgotten')
  t.same(replaced(), [], 'forgetting is not a replacement')
  clock.advance(3_600_000)
  reg.observeEngineId('p', 'X_dp5')
  t.same(ids(), ['X_dp2', 'X_dp3', 'X_dp4', 'X_dp5'], 'ranks are not forgotten by time: their replacement keeps the set small')

  // A URL over several pods: pods come and go and nothing replaces them.
  reg.observeEngineId('d', 'A')
  reg.observeEngineId('d', 'B')
  reg.observeEngineId('d', 'A')
  t.equal(reg.describe('d')?.sharedRanks, true)
  clock.advance(30_000)
  reg.observeEngineId('d', 'C')
  clock.advance(40_000)
  reg.observeEngineId('d', 'C')
  t.same(ids('d'), ['C'], 'engine_ids not seen for the TTL are forgotten there')
  clock.advance(3_600_000)
  reg.observeEngineId('d', 'C')
  t.same(ids('d'), ['C'], 'never the last one that answered')
  reg.observeEngineId('d', 'D')
  reg.observeEngineId('d', 'C')
  clock.advance(70_000)
  reg.observeEngineId('d', 'C')
  t.same(ids('d'), ['C'], 'the newest goes too when it stops answering')
  t.equal(reg.snapshot().instances.find((i) => i.id === 'd')?.engineId, 'C', 'engineId then names one still held')
  t.same(replaced(), ['A->B'])
})

t.test('describe carries the set for another router; observing it there rebuilds the same set', async (t) => {
  const a = registry()
  for (const e of ['A', 'B', 'A', 'C']) a.reg.observeEngineId('p', e)
  const d = a.reg.describe('p')
  t.same([...(d?.engineIds ?? [])].sort(), ['A', 'B', 'C'])
  const b = registry()
  b.reg.observeEngineId('p', 'A')
  if (d?.sharedRanks) b.reg.markSharedRanks('p')
  for (const e of d?.engineIds ?? []) b.reg.observeEngineId('p', e)
  t.same(b.ids(), ['A', 'B', 'C'])
  t.same(b.replaced(), [], 'nothing replaced on the router that applied it')
})

function events() {
  const clock = new ManualClock()
  const registry = new TopologyRegistry({ clock, policy, instances: [{ id: 'p', role: 'prefill', url: 'http://127.0.0.1:1001' }] })
  const ev = new RouterEvents({ store: new MemoryEventStore({ clock }), agents: new AgentDirectory({ clock }), registry, logger: { info: () => {}, warn: () => {}, error: () => {} } })
  t.teardown(() => ev.close())
  const gone = async () => (await ev.store.since(0)).filter((e) => e.type === 'peer_gone').map((e) => (e.type === 'peer_gone' ? e.engineIds : []))
  return { clock, registry, events: ev, gone }
}

t.test('RouterEvents: ranks alternating log nothing; a rank replaced is peer_gone for it alone', async (t) => {
  const { registry, events: ev, gone } = events()
  for (let i = 0; i < 60; i++) {
    registry.observeEngineId('p', `X_dp${i % 2}`)
    ev.engineAnswered(`X_dp${i % 2}`)
    await ev.settled()
  }
  const logged = await ev.store.since(0)
  t.comment(`60 answers from 2 ranks: ${logged.filter((e) => e.type === 'peer_gone').length} peer_gone, ${logged.filter((e) => e.type === 'peer_alive').length} peer_alive`)
  t.same(await gone(), [], 'no peer_gone for live ranks')
  t.equal(await ev.store.last(), 0, 'nothing logged at all')
  registry.observeEngineId('p', 'Y_dp1')
  await ev.settled()
  t.same(await gone(), [['X_dp1']])
})

t.test('RouterEvents: a crash, an address and a drain name every engine_id of the instance', async (t) => {
  const { clock, registry, events: ev, gone } = events()
  for (const e of ['X_dp0', 'X_dp1']) registry.observeEngineId('p', e)
  registry.recordProbe('p', true)
  t.match(await ev.peerGone({ addresses: ['127.0.0.1:1001'] }, 'ops'), { seq: null, aliveSkipped: ['X_dp0', 'X_dp1'] }, 'both are up and answering there')
  registry.recordProbe('p', false, undefined, true)
  registry.recordProbe('p', false, undefined, true)
  await ev.settled()
  t.same((await gone()).map((ids) => [...ids].sort()), [['X_dp0', 'X_dp1']], 'refusing and no agent stream: every rank crashed')

  registry.add({ id: 'q', role: 'prefill', url: 'http://127.0.0.1:1003' })
  for (const e of ['Y_dp0', 'Y_dp1']) registry.observeEngineId('q', e)
  const drainer = new Drainer({ registry, ledger: new MemoryLeaseLedger({ clock, leaseSeconds: 30, marginMs: 1000, retentionMs: 1000, maxEntries: 100 }), events: ev, clock, logger: { info: () => {} }, pollMs: 100 })
  t.teardown(() => drainer.close())
  await drainer.drain('q')
  t.ok(await waitFor(() => !registry.has('q'), 2000))
  t.same((await gone()).map((ids) => [...ids].sort())[1], ['Y_dp0', 'Y_dp1'], 'a drain names both ranks')
})
