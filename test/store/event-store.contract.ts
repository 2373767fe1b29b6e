import { setTimeout as sleep } from 'node:timers/promises'
import type { Test } from 'tap'
import { ManualClock } from '../../common/clock.js'
import type { LoggedEvent } from '../../router/src/events/event-log.js'
import type { EventListener, EventStore, EventStoreOptions } from '../../router/src/store/event-store.js'
import type { SnapshotEvent } from '../../schemas/events.js'

/*
 * The event store's contract (issue 10, DESIGN "State store" and "Events"): every
 * implementation runs these cases. Memory and Redis differ only where the harness says so:
 * whether a second store opened on the same backing shares the log (several routers, a
 * restart) or starts a new one.
 */
export interface EventStoreBacking {
  /** Opens a store on this case's backing; closed when the case ends. */
  open(opts: EventStoreOptions): Promise<EventStore>
}

export interface EventStoreHarness {
  /** A fresh, empty backing for one case. */
  backing(t: Test): Promise<EventStoreBacking>
  /** Whether stores opened on one backing share one log (Redis) or each keep their own (memory). */
  shared: boolean
}

const peerGone = (ids: string[]) => ({ type: 'peer_gone' as const, engineIds: ids, addresses: [], reason: 'test' })
const release = (r: string) => ({ type: 'lease_release' as const, prefillEngineId: 'p', requestIds: [r], reason: 'client_gone' })

/** Collects what a listener sees; `until(n)` waits (real time, bounded) until it saw n events. */
function collector(store: EventStore): { seen: (LoggedEvent | SnapshotEvent)[]; off: () => void; until(n: number): Promise<void> } {
  const seen: (LoggedEvent | SnapshotEvent)[] = []
  const listener: EventListener = (e) => seen.push(e)
  const off = store.subscribe(listener)
  return {
    seen,
    off,
    async until(n) {
      const deadline = Date.now() + 5000
      while (seen.length < n && Date.now() < deadline) await sleep(5)
    },
  }
}

export function eventStoreContract(t: Test, harness: EventStoreHarness): void {
  t.test('sequence numbers in order; since; at from the injected clock', async (t) => {
    const clock = new ManualClock()
    const store = await (await harness.backing(t)).open({ clock })
    t.equal(await store.last(), 0)
    t.equal(await store.first(), 1, 'an empty log: first is last + 1')
    const a = await store.append(peerGone(['e1']), ['x'])
    clock.advance(5)
    const b = await store.append(release('r1'), ['x'])
    t.same([a.seq, b.seq], [1, 2])
    t.equal(b.at - a.at, 5, 'at is the injected wall clock')
    t.match(b, { type: 'lease_release', prefillEngineId: 'p', requestIds: ['r1'], reason: 'client_gone' })
    await store.append(peerGone(['e2']), [])
    t.same(
      (await store.since(1)).map((e) => e.seq),
      [2, 3],
    )
    t.same(await store.since(0), [a, b, { ...peerGone(['e2']), seq: 3, at: b.at }], 'events come back as they were logged')
    t.same(await store.since(3), [], 'nothing after the last')
    t.same(await store.since(10), [], 'after a sequence this log never had: nothing')
    t.equal(await store.last(), 3)
    t.equal(await store.first(), 1)
    t.match(store.id, /^[0-9a-f-]{36}$/, 'a random id')
  })

  t.test('retention must be a positive integer', async (t) => {
    const backing = await harness.backing(t)
    await t.rejects(async () => backing.open({ clock: new ManualClock(), retention: 0 }), RangeError)
  })

  t.test('listeners see each event once, in order, until they unsubscribe', async (t) => {
    const store = await (await harness.backing(t)).open({ clock: new ManualClock() })
    const one = collector(store)
    const two = collector(store)
    for (let i = 1; i <= 20; i++) await store.append(peerGone([`e${i}`]), [])
    await one.until(20)
    await two.until(20)
    t.same(
      one.seen.map((e) => e.seq),
      Array.from({ length: 20 }, (_, i) => i + 1),
    )
    t.same(two.seen, one.seen)
    one.off()
    await store.append(peerGone(['late']), [])
    await two.until(21)
    await sleep(20)
    t.equal(one.seen.length, 20, 'unsubscribed: nothing more')
    t.equal(two.seen.length, 21)
    t.match(two.seen[20], { seq: 21, type: 'peer_gone', engineIds: ['late'] })
  })

  t.test('subscribe, then replay with since: nothing logged in between is lost', async (t) => {
    const store = await (await harness.backing(t)).open({ clock: new ManualClock() })
    for (let i = 1; i <= 3; i++) await store.append(peerGone([`e${i}`]), [])
    const live = collector(store)
    const appending = (async () => {
      for (let i = 4; i <= 10; i++) await store.append(peerGone([`e${i}`]), [])
    })()
    const replay = await store.since(0)
    await appending
    await live.until(7)
    await sleep(20)
    const got = new Set([...replay, ...live.seen].map((e) => e.seq))
    t.same(
      [...got].sort((x, y) => x - y),
      [1, 2, 3, 4, 5, 6, 7, 8, 9, 10],
    )
    const liveSeqs = live.seen.map((e) => e.seq)
    t.same(
      liveSeqs.filter((s) => s >= 4),
      [4, 5, 6, 7, 8, 9, 10],
      'the listener sees everything logged after it subscribed, in order (earlier ones it may see too)',
    )
    t.same(liveSeqs, [...new Set(liveSeqs)].sort((x, y) => x - y), 'once each, in order')
  })

  t.test('since with a limit: a page at a time, a snapshot counted as one', async (t) => {
    const store = await (await harness.backing(t)).open({ clock: new ManualClock(), retention: 5 })
    for (let i = 1; i <= 8; i++) await store.append(peerGone([`e${i}`]), [])
    t.same(
      (await store.since(0, 3)).map((e) => [e.type, e.seq]),
      [
        ['snapshot', 3],
        ['peer_gone', 4],
        ['peer_gone', 5],
      ],
    )
    t.same(
      (await store.since(5, 2)).map((e) => e.seq),
      [6, 7],
    )
    t.same(
      (await store.since(7, 10)).map((e) => e.seq),
      [8],
    )
  })

  t.test('retention drops the oldest; an agent behind it gets a snapshot first', async (t) => {
    const clock = new ManualClock()
    const store = await (await harness.backing(t)).open({ clock, retention: 3 })
    for (let i = 1; i <= 5; i++) await store.append(peerGone([`e${i}`]), ['a'])
    t.equal(await store.first(), 3)
    t.equal(await store.last(), 5)
    const behind = await store.since(1)
    t.equal(behind[0]?.type, 'snapshot', 'behind retention: a snapshot first')
    t.match(behind[0], { seq: 2, goneEngineIds: ['e1', 'e2', 'e3', 'e4', 'e5'], at: clock.now() })
    t.same(
      behind.slice(1).map((e) => e.seq),
      [3, 4, 5],
      'then everything held',
    )
    t.same(
      (await store.since(2)).map((e) => e.seq),
      [3, 4, 5],
      'just at the edge: no snapshot needed',
    )
    t.match(await store.snapshot(), { seq: 2, type: 'snapshot' })
    t.equal(await store.delivery(1), undefined, 'delivery of a dropped event is unknown')
    t.equal(await store.undelivered(new Set(['a'])), 3, 'only held events count')
  })

  t.test('a gone engine_id stays in snapshots for goneTtlMs', async (t) => {
    const clock = new ManualClock()
    const store = await (await harness.backing(t)).open({ clock, retention: 1, goneTtlMs: 1000 })
    await store.append(peerGone(['old']), [])
    clock.advance(600)
    await store.append(peerGone(['newer']), [])
    t.ok(await store.isGone('old'))
    t.notOk(await store.isGone('never'))
    clock.advance(400)
    t.notOk(await store.isGone('old'), 'expired at its TTL')
    t.ok(await store.isGone('newer'))
    t.same((await store.snapshot()).goneEngineIds, ['newer'])
    // Declared gone again: its age restarts.
    await store.append(peerGone(['old']), [])
    clock.advance(700)
    t.same((await store.snapshot()).goneEngineIds, ['old'], "'newer' expired, 'old' was renewed")
    t.same((await store.since(0))[0], { seq: 2, type: 'snapshot', goneEngineIds: ['old'], at: clock.now() })
  })

  t.test('lastPeerGone: the latest held event naming every engine_id', async (t) => {
    const store = await (await harness.backing(t)).open({ clock: new ManualClock() })
    await store.append(peerGone(['a', 'b']), [])
    await store.append(peerGone(['a']), [])
    await store.append(release('r'), [])
    t.match(await store.lastPeerGone(['a']), { seq: 2 })
    t.match(await store.lastPeerGone(['a', 'b']), { seq: 1, engineIds: ['a', 'b'] }, 'an older event that names them all')
    t.equal(await store.lastPeerGone(['c']), undefined)
    for (let i = 0; i < 150; i++) await store.append(release(`r${i}`), [])
    t.match(await store.lastPeerGone(['b']), { seq: 1 }, 'found past many newer events')
  })

  t.test('appendPeerGone logs only engine_ids not already gone, and nothing when all were', async (t) => {
    const clock = new ManualClock()
    const store = await (await harness.backing(t)).open({ clock, goneTtlMs: 1000 })
    const first = await store.appendPeerGone({ ...peerGone(['a', 'b']), addresses: ['h:1'] }, ['x'])
    t.match(first, { seq: 1, type: 'peer_gone', engineIds: ['a', 'b'], addresses: ['h:1'], reason: 'test' })
    const second = await store.appendPeerGone(peerGone(['b', 'c/1']), ['x'])
    t.match(second, { seq: 2, engineIds: ['c/1'] }, 'b was gone already; an id with a slash survives the JSON round trip')
    t.equal(await store.appendPeerGone(peerGone(['a', 'c/1']), ['x']), undefined, 'all gone: nothing logged')
    t.equal(await store.last(), 2)
    t.same(
      (await store.since(0)).map((e) => (e.type === 'peer_gone' ? e.engineIds : [])),
      [['a', 'b'], ['c/1']],
      'the log holds what was returned',
    )
    t.same((await store.delivery(2))?.expected, ['x'])
    t.ok(await store.isGone('c/1'))
    clock.advance(1001)
    t.match(await store.appendPeerGone(peerGone(['a']), []), { seq: 3, engineIds: ['a'] }, 'gone again once past goneTtlMs')
  })

  t.test('appendPeerAlive: engine_ids still gone stop being gone, logged once; nothing when none was (issue 17 item 6)', async (t) => {
    const clock = new ManualClock()
    const store = await (await harness.backing(t)).open({ clock, goneTtlMs: 1000 })
    const seen: string[] = []
    store.subscribe((e) => seen.push(`${e.type}:${'engineIds' in e ? e.engineIds.join(',') : ''}`))
    await store.appendPeerGone(peerGone(['a', 'b/1']), ['x'])
    t.equal(await store.appendPeerAlive({ type: 'peer_alive', engineIds: ['nobody'], reason: 'test' }, ['x']), undefined, 'never gone: nothing logged')
    const alive = await store.appendPeerAlive({ type: 'peer_alive', engineIds: ['b/1', 'nobody'], reason: 'answered' }, ['x', 'y'])
    t.match(alive, { seq: 2, type: 'peer_alive', engineIds: ['b/1'], reason: 'answered' }, 'only the gone one, its slash intact')
    t.notOk(await store.isGone('b/1'), 'no longer gone')
    t.ok(await store.isGone('a'), 'the other one still is')
    t.same((await store.snapshot()).goneEngineIds, ['a'], 'snapshots leave it out')
    t.same((await store.delivery(2))?.expected.sort(), ['x', 'y'])
    t.equal(await store.appendPeerAlive({ type: 'peer_alive', engineIds: ['b/1'], reason: 'again' }, ['x']), undefined, 'a repeat logs nothing')
    t.match(await store.appendPeerGone(peerGone(['b/1']), ['x']), { seq: 3, engineIds: ['b/1'] }, 'and it can be declared gone again')
    clock.advance(1001)
    t.equal(await store.appendPeerAlive({ type: 'peer_alive', engineIds: ['a'], reason: 'late' }, ['x']), undefined, 'past goneTtlMs it is not gone any more: nothing to lift')
    t.same((await store.since(0)).map((e) => e.type), ['peer_gone', 'peer_alive', 'peer_gone'])
    await new Promise((r) => setTimeout(r, 50))
    t.same(seen.slice(0, 3), ['peer_gone:a,b/1', 'peer_alive:b/1', 'peer_gone:b/1'], 'subscribers hear it in order')
  })

  t.test('acks and delivery', async (t) => {
    const clock = new ManualClock()
    const store = await (await harness.backing(t)).open({ clock })
    const e1 = await store.append(peerGone(['e1']), ['a', 'b'])
    const e2 = await store.append(peerGone(['e2']), ['a', 'b', 'c'])
    t.same(await store.delivery(e1.seq), { seq: 1, type: 'peer_gone', engineIds: ['e1'], applied: [], expected: ['a', 'b'] })
    t.equal(await store.undelivered(new Set(['a', 'b', 'c'])), 2)
    await store.ack('a', 2)
    t.same((await store.delivery(e1.seq))?.applied, ['a'], 'an ack covers every earlier sequence')
    await store.ack('a', 1)
    t.equal(await store.acked('a'), 2, 'an older ack never moves back')
    t.equal(await store.undelivered(new Set(['a'])), 0)
    await store.ack('b', 99)
    t.equal(await store.acked('b'), 0, 'an ack past the last sequence is ignored')
    await store.ack('b', 1)
    t.equal(await store.undelivered(new Set(['b'])), 1)
    t.equal(await store.undelivered(new Set(['b', 'nobody'])), 1, 'an agent nothing was for waits for nothing')
    await store.ack('c', 2)
    t.same((await store.delivery(e1.seq))?.applied, ['a', 'b'])
    t.same((await store.delivery(e2.seq))?.applied, ['a', 'c'])
    t.equal(await store.delivery(3), undefined)
    t.equal(await store.acked('nobody'), 0)
    t.equal(await store.undelivered(new Set()), 0)
    const none = await store.append(release('r'), [])
    t.same(await store.delivery(none.seq), { seq: 3, type: 'lease_release', engineIds: ['p'], applied: [], expected: [] }, 'an event for nobody')
  })

  t.test('onDelivered: once per event, when its last expected agent acknowledged it', async (t) => {
    const clock = new ManualClock()
    const delivered: [number, number][] = []
    const store = await (await harness.backing(t)).open({ clock, onDelivered: (e, ms) => delivered.push([e.seq, ms]) })
    await store.append(peerGone(['e1']), ['a', 'b'])
    await store.append(peerGone(['e2']), ['a'])
    await store.append(peerGone(['e3']), [])
    clock.advance(30)
    await store.ack('a', 2)
    t.same(delivered, [[2, 30]], "e2 waited only for a; e1 still waits for b; e3 for nobody (never 'delivered')")
    clock.advance(10)
    await store.ack('b', 3)
    await store.ack('b', 3)
    await store.ack('a', 3)
    t.same(delivered, [
      [2, 30],
      [1, 40],
    ])
  })

  // Issue 18 item 3: every collection a caller can grow has a bound, delivery bookkeeping too.
  t.test('events expecting the same agents share their delivery bookkeeping', async (t) => {
    const clock = new ManualClock()
    const delivered: number[] = []
    const store = await (await harness.backing(t)).open({ clock, onDelivered: (e) => delivered.push(e.seq) })
    const agents = Array.from({ length: 50 }, (_, i) => `agent-${i}`)
    for (let i = 1; i <= 100; i++) await store.append(peerGone([`e${i}`]), agents)
    // A lease release for one owner between peer_gones for all of them.
    for (let i = 1; i <= 20; i++) {
      await store.append(peerGone([`f${i}`]), agents)
      await store.append(release(`r${i}`), ['agent-1'])
    }
    t.match(await store.stats(), { events: 140, tracked: 51 }, 'the 50 agents held once, the owner once: not 5,020 entries')
    await store.ack('agent-0', 100)
    t.same((await store.delivery(100))?.applied, ['agent-0'], 'delivery is still per event')
    t.same((await store.delivery(101))?.applied, [])
    for (const a of agents) await store.ack(a, 2)
    t.same(delivered, [1, 2], 'delivered once all 50 acknowledged')
    await store.ack('agent-1', 102)
    t.same(delivered, [1, 2, 102], 'the lease release waited for its owner alone')
    t.same((await store.delivery(102))?.expected, ['agent-1'])
    t.equal(await store.undelivered(new Set(['agent-0'])), 20, 'the peer_gones after 100 still wait for agent-0')
  })

  t.test('past deliveryEntries the oldest events go, as past retention', async (t) => {
    const clock = new ManualClock()
    const store = await (await harness.backing(t)).open({ clock, retention: 100, deliveryEntries: 10 })
    // Six events, each for four agents no other event is for.
    for (let i = 1; i <= 6; i++) await store.append(peerGone([`e${i}`]), ['a', 'b', 'c', 'd'].map((x) => `${x}${i}`))
    t.match(await store.stats(), { events: 2, tracked: 8 }, 'two events fit in 10 entries')
    t.equal(await store.first(), 5)
    t.equal((await store.since(0))[0]?.type, 'snapshot', 'an agent behind them gets a snapshot, as behind retention')
    t.equal(await store.delivery(4), undefined)
    t.same((await store.delivery(6))?.expected, ['a6', 'b6', 'c6', 'd6'])
    await store.append(peerGone(['big']), Array.from({ length: 20 }, (_, i) => `x${i}`))
    t.match(await store.stats(), { events: 1, tracked: 20 }, 'the newest event is kept, whatever it is for')
    t.equal(await store.first(), 7)
    await store.append(peerGone(['none']), [])
    t.match(await store.stats(), { events: 1, tracked: 0 }, 'the next event, for nobody, pushes out the one past the bound')
  })

  t.test('acks of agents no held event is for are forgotten past ackFloor', async (t) => {
    const store = await (await harness.backing(t)).open({ clock: new ManualClock(), ackFloor: 4 })
    await store.append(peerGone(['e1']), ['a'])
    await store.ack('a', 1)
    for (let i = 0; i < 50; i++) await store.ack(`left-${i}`, 1)
    t.ok((await store.stats()).acks <= 5, 'at most ackFloor, plus the one taken since')
    t.equal(await store.acked('a'), 1, 'an agent a held event is for keeps its ack')
    t.same((await store.delivery(1))?.applied, ['a'])
  })

  if (harness.shared) {
    t.test('two stores on one backing (two routers) share one log, in one order', async (t) => {
      const clock = new ManualClock()
      const backing = await harness.backing(t)
      const r1 = await backing.open({ clock })
      const r2 = await backing.open({ clock })
      t.equal(r2.id, r1.id, 'one log, one id')
      const l1 = collector(r1)
      const l2 = collector(r2)
      // Interleaved and concurrent: each router appends 25 events at once.
      await Promise.all([
        Promise.all(Array.from({ length: 25 }, (_, i) => r1.append(peerGone([`r1-${i}`]), ['a']))),
        Promise.all(Array.from({ length: 25 }, (_, i) => r2.append(peerGone([`r2-${i}`]), ['a']))),
      ])
      await l1.until(50)
      await l2.until(50)
      t.same(
        l1.seen.map((e) => e.seq),
        Array.from({ length: 50 }, (_, i) => i + 1),
        'every event once, in sequence order',
      )
      t.same(l2.seen, l1.seen, "both routers' listeners see the same events in the same order")
      t.same(await r2.since(0), await r1.since(0))
      t.equal(await r1.last(), 50)
      await r1.ack('a', 50)
      t.equal(await r2.acked('a'), 50, "an ack taken by one router is the other's too")
      t.same((await r2.delivery(7))?.applied, ['a'])
      t.ok(await r2.isGone('r1-3'))
    })

    t.test('two routers declaring the same engines gone at once log each engine_id once', async (t) => {
      const backing = await harness.backing(t)
      const [a, b] = await Promise.all([backing.open({ clock: new ManualClock() }), backing.open({ clock: new ManualClock() })])
      const results = await Promise.all(Array.from({ length: 20 }, (_, i) => (i % 2 ? a : b).appendPeerGone(peerGone(['e1', 'e2', `e${3 + (i % 3)}`]), [])))
      const logged = results.filter((r) => r !== undefined).flatMap((r) => r?.engineIds ?? [])
      t.same(logged.sort(), ['e1', 'e2', 'e3', 'e4', 'e5'], 'each engine_id in exactly one event')
      t.equal(await a.last(), results.filter((r) => r !== undefined).length)
    })

    t.test('a restarted store keeps the log: id, last, events, acks, gone engine_ids', async (t) => {
      const clock = new ManualClock()
      const backing = await harness.backing(t)
      const before = await backing.open({ clock })
      await before.append(peerGone(['e1']), ['a'])
      await before.append(release('r'), ['a'])
      await before.ack('a', 1)
      const events = await before.since(0)
      await before.close()
      const after = await backing.open({ clock })
      t.equal(after.id, before.id)
      t.equal(await after.last(), 2)
      t.same(await after.since(0), events)
      t.equal(await after.acked('a'), 1)
      t.ok(await after.isGone('e1'))
      const live = collector(after)
      const next = await after.append(peerGone(['e2']), ['a'])
      t.equal(next.seq, 3, 'the sequence goes on')
      await live.until(1)
      t.same(
        live.seen.map((e) => e.seq),
        [3],
        'a restarted store delivers only what comes after it opened',
      )
    })
  } else {
    t.test('each store is its own log: a new one starts over under a new id', async (t) => {
      const clock = new ManualClock()
      const backing = await harness.backing(t)
      const before = await backing.open({ clock })
      await before.append(peerGone(['e1']), [])
      await before.close()
      const after = await backing.open({ clock })
      t.not(after.id, before.id, 'agents see another id and start over from 0')
      t.equal(await after.last(), 0)
    })
  }

  t.test('close stops live delivery', async (t) => {
    const store = await (await harness.backing(t)).open({ clock: new ManualClock() })
    const live = collector(store)
    await store.append(peerGone(['e1']), [])
    await live.until(1)
    await store.close()
    await store.close()
    t.equal(live.seen.length, 1)
  })
}
