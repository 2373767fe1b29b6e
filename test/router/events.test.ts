import t from 'tap'
import { ManualClock } from '../../common/clock.js'
import { AgentDirectory } from '../../router/src/events/agent-directory.js'
import { EventLog } from '../../router/src/events/event-log.js'
import { RouterEvents } from '../../router/src/events/router-events.js'
import { MemoryLeaseLedger } from '../../router/src/leases/memory-ledger.js'
import { MemoryEventStore } from '../../router/src/store/event-store.js'
import { Drainer } from '../../router/src/topology/drainer.js'
import { TopologyRegistry } from '../../router/src/topology/registry.js'
import { waitFor } from '../helpers/cluster.js'

/*
 * Issue 9, the event log (DESIGN "Events: router → agents"): sequence order, bounded
 * retention with a snapshot for an agent behind it, the gone set's TTL, acks and delivery;
 * and where the router decides to emit: engine_id changes, agent re-registrations, ops
 * peer_gone (idempotent, unknown targets a no-op, addresses resolved to engine_ids).
 */

const peerGone = (ids: string[]) => ({ type: 'peer_gone' as const, engineIds: ids, addresses: [], reason: 'test' })

t.test('EventLog: sequence numbers in order, listeners see each event once', async (t) => {
  const clock = new ManualClock()
  const log = new EventLog({ clock })
  const seen: number[] = []
  const off = log.subscribe((e) => seen.push(e.seq))
  t.equal(log.last, 0)
  t.equal(log.first, 1, 'an empty log: first is last + 1')
  const a = log.append(peerGone(['e1']), ['x'])
  clock.advance(5)
  const b = log.append({ type: 'lease_release', prefillEngineId: 'p', requestIds: ['r1'], reason: 'client_gone' }, ['x'])
  t.same([a.seq, b.seq], [1, 2])
  t.equal(b.at - a.at, 5, 'at is the injected wall clock')
  t.same(seen, [1, 2])
  off()
  log.append(peerGone(['e2']), [])
  t.same(seen, [1, 2], 'unsubscribed')
  t.same(
    log.since(1).map((e) => e.seq),
    [2, 3],
  )
  t.same(log.since(3), [], 'nothing after the last')
  t.same(log.since(10), [], 'after a sequence this log never had: nothing (agents detect it at registration)')
  t.match(log.id, /^[0-9a-f-]{36}$/, 'a random id per log')
  t.not(new EventLog({ clock }).id, log.id)
  t.equal(new EventLog({ clock, id: 'fixed' }).id, 'fixed')
  t.throws(() => new EventLog({ clock, retention: 0 }), RangeError)
})

t.test('EventLog: retention drops the oldest; an agent behind it gets a snapshot first', async (t) => {
  const clock = new ManualClock()
  const log = new EventLog({ clock, retention: 3 })
  for (let i = 1; i <= 5; i++) log.append(peerGone([`e${i}`]), ['a'])
  t.equal(log.size, 3)
  t.equal(log.first, 3)
  t.equal(log.last, 5)
  const behind = log.since(1)
  t.equal(behind[0]?.type, 'snapshot', 'behind retention: a snapshot first')
  t.match(behind[0], { seq: 2, goneEngineIds: ['e1', 'e2', 'e3', 'e4', 'e5'] })
  t.same(
    behind.slice(1).map((e) => e.seq),
    [3, 4, 5],
    'then everything held',
  )
  t.same(
    log.since(2).map((e) => e.seq),
    [3, 4, 5],
    'just at the edge: no snapshot needed',
  )
  t.equal(log.delivery(1), undefined, 'delivery of a dropped event is unknown')
})

t.test('EventLog: a gone engine_id stays in snapshots for goneTtlMs', async (t) => {
  const clock = new ManualClock()
  const log = new EventLog({ clock, retention: 1, goneTtlMs: 1000 })
  log.append(peerGone(['old']), [])
  clock.advance(600)
  log.append(peerGone(['newer']), [])
  t.ok(log.isGone('old'))
  clock.advance(400)
  t.notOk(log.isGone('old'), 'expired at its TTL')
  t.ok(log.isGone('newer'))
  t.same(log.snapshot().goneEngineIds, ['newer'])
  // Declared gone again: its age restarts.
  log.append(peerGone(['old']), [])
  clock.advance(700)
  t.same(log.snapshot().goneEngineIds, ['old'], "'newer' expired, 'old' was renewed")
})

t.test('EventLog: acks and delivery', async (t) => {
  const clock = new ManualClock()
  const log = new EventLog({ clock })
  const e1 = log.append(peerGone(['e1']), ['a', 'b'])
  const e2 = log.append(peerGone(['e2']), ['a', 'b', 'c'])
  t.same(log.delivery(e1.seq), { seq: 1, type: 'peer_gone', engineIds: ['e1'], applied: [], expected: ['a', 'b'] })
  log.ack('a', 2)
  t.same(log.delivery(e1.seq)?.applied, ['a'], 'an ack covers every earlier sequence')
  log.ack('a', 1)
  t.equal(log.acked('a'), 2, 'an older ack never moves back')
  log.ack('b', 99)
  t.equal(log.acked('b'), 0, 'an ack past the last sequence is ignored')
  log.ack('b', 1)
  log.ack('c', 2)
  t.same(log.delivery(e1.seq)?.applied, ['a', 'b'])
  t.same(log.delivery(e2.seq)?.applied, ['a', 'c'])
  t.equal(log.delivery(3), undefined)
  t.equal(log.acked('nobody'), 0)
})

const policy = { unhealthyThreshold: 2, baseEjectionMs: 1000, maxEjectionMs: 3000 }

function setup() {
  const clock = new ManualClock()
  const registry = new TopologyRegistry({
    clock,
    policy,
    instances: [
      { id: 'p', role: 'prefill', url: 'http://127.0.0.1:1001' },
      { id: 'd', role: 'decode', url: 'http://127.0.0.1:1002/' },
    ],
  })
  const logged: { level: string; msg: string }[] = []
  const events = new RouterEvents({
    store: new MemoryEventStore({ clock }),
    agents: new AgentDirectory({ clock }),
    registry,
    logger: { info: (_o, msg) => logged.push({ level: 'info', msg }), warn: (_o, msg) => logged.push({ level: 'warn', msg }), error: (_o, msg) => logged.push({ level: 'error', msg }) },
  })
  return { clock, registry, events, logged }
}

/** A memory store whose peer_gone appends fail while `failing` says so: an outage (retryable) or for good. */
class FlakyStore extends MemoryEventStore {
  failing: (engineIds: readonly string[]) => 'outage' | 'for good' | undefined = () => undefined
  override async appendPeerGone(input: Parameters<MemoryEventStore['appendPeerGone']>[0], expected: readonly string[]) {
    const how = this.failing(input.engineIds)
    if (how) throw Object.assign(new Error(how === 'outage' ? 'Connection is closed.' : 'ERR a script error'), { how })
    return super.appendPeerGone(input, expected)
  }
  override retryable(err: unknown): boolean {
    return (err as { how?: string }).how === 'outage'
  }
}

t.test('RouterEvents: an engine_id change at an instance becomes peer_gone for the old id', async (t) => {
  const { registry, events } = setup()
  registry.observeEngineId('p', 'p-1')
  await events.settled()
  t.equal((await events.store.last()), 0, 'the first engine_id replaces nothing')
  registry.observeEngineId('p', 'p-2')
  await events.settled()
  const [e] = (await events.store.since(0))
  t.match(e, { seq: 1, type: 'peer_gone', engineIds: ['p-1'], reason: /engine_id_changed at 127\.0\.0\.1:1001/ })
  registry.observeEngineId('p', 'p-2')
  await events.settled()
  t.equal((await events.store.last()), 1, 'the same engine_id again: nothing')
})

t.test('RouterEvents: a registration ties an agent to its instance; what it claims is never the engine\'s word (issue 18 item 2)', async (t) => {
  const { registry, events } = setup()
  const rec = await events.registerAgent({ agentId: 'a-p', engineId: 'p-1', role: 'prefill', agentUrl: 'http://127.0.0.1:2001', engineUrl: 'http://127.0.0.1:1001/' })
  t.equal(rec.instanceId, 'p', 'tied to its instance by the engine URL (trailing slash ignored)')
  t.equal(rec.peerAddress, '127.0.0.1:2001')
  t.equal(registry.snapshot().instances.find((i) => i.id === 'p')?.engineId, undefined, 'the instance learns its engine_id from the engine, not from a registration')
  await events.registerAgent({ agentId: 'a-d', engineId: 'd-1', role: 'decode', agentUrl: 'http://127.0.0.1:2002', engineUrl: 'http://127.0.0.1:1002' })
  await events.registerAgent({ agentId: 'a-p', engineId: 'p-1', role: 'prefill', agentUrl: 'http://127.0.0.1:2001', engineUrl: 'http://127.0.0.1:1001' })
  t.equal(await events.store.last(), 0, 'registrations log nothing')

  // The reproduction: anyone posting a registration naming the prefiller's URL and a new
  // engine_id made the router declare the real engine gone.
  registry.observeEngineId('p', 'p-real')
  await events.settled()
  await events.registerAgent({ agentId: 'a-p', engineId: 'p-forged', role: 'prefill', agentUrl: 'http://127.0.0.1:2001', engineUrl: 'http://127.0.0.1:1001' })
  await events.registerAgent({ agentId: 'a-evil', engineId: 'p-forged-2', role: 'prefill', agentUrl: 'http://127.0.0.1:2001', engineUrl: 'http://127.0.0.1:1001' })
  await events.settled()
  t.equal(await events.store.last(), 0, 'a claimed engine_id, or a new agent at the same address, declares nothing gone')
  t.equal(registry.snapshot().instances.find((i) => i.id === 'p')?.engineId, 'p-real', 'and renames nothing')
  t.equal(events.agents.get('a-p'), undefined, 'the replaced record leaves the directory')

  // The engine itself answering under a new engine_id is what says the old one is gone.
  registry.observeEngineId('p', 'p-2')
  await events.settled()
  t.match(await events.store.since(0), [{ type: 'peer_gone', engineIds: ['p-real'], reason: /engine_id_changed/ }])
  t.same((await events.store.delivery(1))?.expected.sort(), ['a-d', 'a-evil'], 'every agent is expected to apply it')
})

t.test('RouterEvents: ops peer_gone is idempotent; unknown targets are no-ops; addresses resolve', async (t) => {
  const { registry, events } = setup()
  await events.registerAgent({ agentId: 'a-p', engineId: 'p-1', role: 'prefill', agentUrl: 'http://127.0.0.1:2001', engineUrl: 'http://127.0.0.1:1001' })
  await events.registerAgent({ agentId: 'a-d', engineId: 'd-1', role: 'decode', agentUrl: 'http://127.0.0.1:2002' })

  const first = await events.peerGone({ engineIds: ['p-1'] }, 'ops')
  t.same(first, { seq: 1, engineIds: ['p-1'], unknown: [], aliveSkipped: [], logged: true })
  t.match((await events.store.since(0))[0], { engineIds: ['p-1'], addresses: ['127.0.0.1:2001'] }, "the agent's peer address goes with it")
  const repeat = await events.peerGone({ engineIds: ['p-1'] }, 'ops again')
  t.same(repeat, { seq: 1, engineIds: ['p-1'], unknown: [], aliveSkipped: [], logged: false }, 'a repeat answers the earlier sequence and logs nothing')
  t.equal((await events.store.last()), 1)

  const unknown = await events.peerGone({ engineIds: ['nobody'], addresses: ['10.9.9.9:1'] }, 'ops')
  t.same(unknown, { seq: null, engineIds: [], unknown: ['nobody', '10.9.9.9:1'], aliveSkipped: [], logged: false })
  t.equal((await events.store.last()), 1, 'unknown targets log nothing')

  // By the agent's peer address, and by an instance's host:port (engine_id from its answers).
  const byAgent = await events.peerGone({ addresses: ['127.0.0.1:2002'] }, 'ops')
  t.match(byAgent, { seq: 2, engineIds: ['d-1'], unknown: [], aliveSkipped: [], logged: true })
  registry.observeEngineId('d', 'd-1')
  await events.settled()
  t.match(await events.peerGone({ addresses: ['127.0.0.1:1002'] }, 'ops'), { seq: 2, engineIds: ['d-1'], logged: false }, 'the same engine by its instance address: a repeat')
  t.match(await events.peerGone({ engineIds: ['p-1', 'nobody'] }, 'ops'), { seq: 1, engineIds: ['p-1'], unknown: ['nobody'], logged: false })

  // Known from an instance's prefill answers only (no agent: engine mode).
  registry.observeEngineId('p', 'p-x')
  await events.settled()
  t.match(await events.peerGone({ engineIds: ['p-x'] }, 'ops'), { seq: 3, logged: true })
})

t.test('RouterEvents: an address never resolves to an engine that is up and answering under its engine_id (issue 17 item 6)', async (t) => {
  const { registry, events } = setup()
  // P restarted at the same address: its new engine is up (probes pass) and known from its answers.
  registry.observeEngineId('p', 'p-old')
  registry.observeEngineId('p', 'p-new')
  await events.settled()
  t.match(await events.store.since(0), [{ type: 'peer_gone', engineIds: ['p-old'] }], 'the restart itself: the old id is gone')
  registry.recordProbe('p', true)
  // A late ops call names the address it saw the old incarnation at.
  const late = await events.peerGone({ addresses: ['127.0.0.1:1001'] }, 'ops: late')
  t.same(late, { seq: null, engineIds: [], unknown: [], aliveSkipped: ['p-new'], logged: false }, 'the live engine there is left alone, and said so')
  t.equal(await events.store.last(), 1, 'nothing logged')
  // An agent that holds a stream counts as answering too (its instance's probes aside).
  await events.registerAgent({ agentId: 'a-d', engineId: 'd-1', role: 'decode', agentUrl: 'http://127.0.0.1:2002' })
  events.agents.streamOpened('a-d')
  t.match(await events.peerGone({ addresses: ['127.0.0.1:2002'] }, 'ops'), { seq: null, aliveSkipped: ['d-1'] })
  events.agents.streamClosed('a-d')
  t.match(await events.peerGone({ addresses: ['127.0.0.1:2002'] }, 'ops'), { seq: 2, engineIds: ['d-1'], aliveSkipped: [], logged: true }, 'no stream, no instance up: gone')
  // Naming the engine_id forces it, up or not.
  t.match(await events.peerGone({ engineIds: ['p-new'] }, 'ops: forced'), { seq: 3, engineIds: ['p-new'], logged: true })
  t.match(await events.peerGone({ addresses: ['127.0.0.1:1001'] }, 'ops'), { seq: 3, engineIds: ['p-new'], aliveSkipped: [], logged: false }, 'once gone, the address is a repeat')
})

t.test('RouterEvents + Drainer: with IP reuse an old pod\'s retirement never names the new pod\'s engine (issue 17 item 6)', async (t) => {
  const { clock, registry, events } = setup()
  const ledger = new MemoryLeaseLedger({ clock, leaseSeconds: 30, marginMs: 1000, retentionMs: 1000, maxEntries: 100 })
  const drainer = new Drainer({ registry, ledger, events, clock, logger: { info: () => {} }, pollMs: 100 })
  t.teardown(() => drainer.close())
  await events.registerAgent({ agentId: 'a-old', engineId: 'e-old', role: 'prefill', agentUrl: 'http://127.0.0.1:2001', engineUrl: 'http://127.0.0.1:1001' })
  t.equal(events.agents.get('a-old')?.instanceId, 'p', 'the old pod’s agent is tied to its instance')
  registry.observeEngineId('p', 'e-old')
  // The old pod terminates; a request holds it, so it drains for a while.
  registry.acquire('p')
  await drainer.drain('p')
  // A new pod got the same IP: its agent registers (before its pod is Ready) for the same URL.
  await events.registerAgent({ agentId: 'a-new', engineId: 'e-new', role: 'prefill', agentUrl: 'http://127.0.0.1:2003', engineUrl: 'http://127.0.0.1:1001' })
  t.equal(events.agents.get('a-new')?.instanceId, undefined, 'not tied to the draining instance of the old pod')
  registry.add({ id: 'p-new', role: 'prefill', url: 'http://127.0.0.1:1001' })
  await new Promise((r) => setImmediate(r))
  t.equal(events.agents.get('a-new')?.instanceId, 'p-new', 'adopted by the new pod’s instance when it joined')
  // The new pod's engine answers a prefill: its engine_id, from the engine itself.
  registry.observeEngineId('p-new', 'e-new')
  registry.release('p')
  t.ok(await waitFor(() => !registry.has('p'), 2000), 'the old pod is retired')
  await events.settled()
  const gone = (await events.store.since(0)).filter((e) => e.type === 'peer_gone')
  t.match(gone, [{ engineIds: ['e-old'] }], 'peer_gone for the old engine only')
  t.notOk(gone.some((e) => (e as { engineIds: string[] }).engineIds.includes('e-new')), 'never for the new pod’s engine')
})

t.test('RouterEvents: an engine declared gone that answers again under its engine_id is peer_alive (issue 17 item 6)', async (t) => {
  const { registry, events } = setup()
  await events.registerAgent({ agentId: 'a-d', engineId: 'd-1', role: 'decode', agentUrl: 'http://127.0.0.1:2002' })
  registry.observeEngineId('p', 'p-fixed')
  await events.settled()
  events.engineAnswered('p-fixed')
  await events.settled()
  t.equal(await events.store.last(), 0, 'an engine that was never gone: nothing')
  await events.peerGone({ engineIds: ['p-fixed'] }, 'ops: wrong')
  await new Promise((r) => setImmediate(r))
  // A prefill answer names it: the engine is up under that engine_id after all.
  events.engineAnswered('p-fixed')
  await events.settled()
  t.match(await events.store.since(1), [{ type: 'peer_alive', engineIds: ['p-fixed'], reason: /answered a prefill/ }])
  t.same((await events.store.delivery(2))?.expected, ['a-d'], 'for every agent')
  t.notOk(await events.store.isGone('p-fixed'))
  events.engineAnswered('p-fixed')
  await events.settled()
  t.equal(await events.store.last(), 2, 'once: the next answers log nothing')
  t.match(await events.peerGone({ engineIds: ['p-fixed'] }, 'ops: again'), { seq: 3, logged: true }, 'and it can be declared gone again')
})

t.test('RouterEvents: lease_release goes to the prefiller engine_id owner only', async (t) => {
  const { events } = setup()
  t.equal(await events.releaseLease({ prefillEngineId: 'p-1', requestIds: ['r'], reason: 'client_gone' }), null, 'no agent runs it: nothing logged')
  await events.registerAgent({ agentId: 'a-p', engineId: 'p-1', role: 'prefill', agentUrl: 'http://127.0.0.1:2001' })
  await events.registerAgent({ agentId: 'a-d', engineId: 'd-1', role: 'decode', agentUrl: 'http://127.0.0.1:2002' })
  const seq = await events.releaseLease({ prefillEngineId: 'p-1', requestIds: ['r'], reason: 'client_gone' })
  t.equal(seq, 1)
  t.same((await events.store.delivery(1))?.expected, ['a-p'])
})

t.test('RouterEvents: a crash (probes refused and no agent stream open) is peer_gone; a partition or a frozen engine is not', async (t) => {
  const { registry, events } = setup()
  await events.registerAgent({ agentId: 'a-p', engineId: 'p-1', role: 'prefill', agentUrl: 'http://127.0.0.1:2001', engineUrl: 'http://127.0.0.1:1001' })
  registry.observeEngineId('p', 'p-1')
  events.agents.streamOpened('a-p')
  registry.recordProbe('p', true)
  await events.settled()
  // Frozen (SIGSTOP, a GC storm): probes time out. Out of routing, not gone.
  registry.recordProbe('p', false)
  registry.recordProbe('p', false)
  registry.recordProbe('p', false)
  events.streamClosed('a-p')
  await events.settled()
  t.notOk(registry.isUp('p'))
  t.equal(await events.store.last(), 0, 'probes time out and even the stream closed: a frozen engine is not a dead one')
  events.agents.streamOpened('a-p')
  // Refused: nothing listens there any more.
  registry.recordProbe('p', false, undefined, true)
  registry.recordProbe('p', false, undefined, true)
  await events.settled()
  t.ok(registry.isRefusing('p'))
  t.equal(await events.store.last(), 0, 'refused, but the agent still holds its stream: a partition, not a crash')
  events.streamClosed('a-p')
  await events.settled()
  t.match(await events.store.since(0), [{ type: 'peer_gone', engineIds: ['p-1'], reason: /instance p down and no agent stream open/ }], 'the stream closing too makes it a crash')
  t.equal(events.agents.get('a-p'), undefined, 'the dead agent leaves the directory (delivery stops waiting for it)')

  // Engine mode (no agent): refused probes alone decide; timeouts never do.
  registry.observeEngineId('d', 'd-1')
  await events.settled()
  registry.recordProbe('d', true)
  for (let i = 0; i < 4; i++) registry.recordProbe('d', false)
  await events.settled()
  t.equal(await events.store.last(), 1, 'an engine that times out is kept')
  registry.recordProbe('d', false, undefined, true)
  await events.settled()
  t.equal(await events.store.last(), 1, 'one refusal is not a streak')
  registry.recordProbe('d', false, undefined, true)
  await events.settled()
  t.match(await events.store.since(1), [{ type: 'peer_gone', engineIds: ['d-1'] }])

  // A stream that closes while its instance is up (the router restarting, a network blip): nothing.
  await events.registerAgent({ agentId: 'a-p2', engineId: 'p-2', role: 'prefill', agentUrl: 'http://127.0.0.1:2002', engineUrl: 'http://127.0.0.1:1001' })
  registry.recordProbe('p', true)
  await events.settled()
  t.notOk(registry.isRefusing('p'), 'a passing probe ends the streak')
  events.agents.streamOpened('a-p2')
  const last = await events.store.last()
  events.streamClosed('a-p2')
  await events.settled()
  t.equal(await events.store.last(), last)
})

t.test('EventLog: delivery is reported once per event, when its last expected agent acknowledges it', async (t) => {
  const clock = new ManualClock()
  const delivered: [number, number][] = []
  const log = new EventLog({ clock, onDelivered: (e, ms) => delivered.push([e.seq, ms]) })
  log.append({ type: 'peer_gone', engineIds: ['x'], addresses: [], reason: 'r' }, ['a', 'b'])
  log.append({ type: 'lease_release', prefillEngineId: 'p', requestIds: ['r1'], reason: 'r' }, ['a'])
  clock.advance(7)
  log.ack('a', 2)
  t.same(delivered, [[2, 7]], "the lease release had one recipient; the peer_gone waits for b")
  clock.advance(5)
  log.ack('b', 1)
  log.ack('b', 1)
  log.ack('a', 2)
  t.same(delivered, [[2, 7], [1, 12]], 'once each, never again on repeated acks')
})

// Issue 21 item 6: a decision the store refuses for good must not hold back every later one;
// one refused for an outage waits, in order, with the ones after it.
t.test('RouterEvents: a decision refused for good is dropped; one refused for an outage is retried in order', async (t) => {
  const clock = new ManualClock()
  const registry = new TopologyRegistry({ clock, policy, instances: [{ id: 'p', role: 'prefill', url: 'http://127.0.0.1:1001' }] })
  const store = new FlakyStore({ clock })
  const logged: string[] = []
  let dropped = 0
  const events = new RouterEvents({
    store,
    agents: new AgentDirectory({ clock }),
    registry,
    retryMs: 10,
    metrics: { events: { inc: () => {} }, decisionsDropped: { inc: () => dropped++ } },
    logger: { info: (_o, msg) => logged.push(msg), warn: (_o, msg) => logged.push(msg), error: (_o, msg) => logged.push(msg) },
  })
  const gone = async () => (await store.since(0)).flatMap((e) => (e.type === 'peer_gone' ? e.engineIds : []))

  store.failing = (ids) => (ids.includes('p-bad') ? 'for good' : undefined)
  for (const id of ['p-bad', 'p-1', 'p-2']) registry.observeEngineId('p', id)
  await events.settled()
  t.same(await gone(), ['p-1'], 'the peer_gone after the one refused for good was logged')
  t.equal(dropped, 1, 'the refused one was counted')
  t.match(logged, [/refused a decision for good/], 'and logged as an error')
  t.equal(events.pending, 0, 'nothing waits')

  let outage = true
  store.failing = () => (outage ? 'outage' : undefined)
  registry.observeEngineId('p', 'p-3')
  registry.observeEngineId('p', 'p-4')
  await events.settled()
  t.equal(events.pending, 2, 'during an outage both wait')
  outage = false
  t.ok(await waitFor(async () => events.pending === 0, 5000), 'and are logged once the store is back')
  t.same(await gone(), ['p-1', 'p-2', 'p-3'], 'in the order they were taken')
  t.equal(dropped, 1, 'none dropped')
})
