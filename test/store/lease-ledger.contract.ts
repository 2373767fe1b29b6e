import { Registry } from 'prom-client'
import type { Test } from 'tap'
import { ManualClock } from '../../common/clock.js'
import type { HandoffLease, LeaseEndReason, LeaseLedger, LeaseRecord } from '../../router/src/leases/ledger.js'
import type { MemoryLeaseLedgerOptions } from '../../router/src/leases/memory-ledger.js'

/*
 * The lease ledger's contract (DESIGN "One request, end to end", steps 4–6; issue 10): every
 * implementation runs these cases on a hand-driven clock. Lifecycle, the lapse check before
 * the decode leg, releases (and what P's agent is told), expiry, retention, the cap, metrics.
 * A Redis ledger answers them from its own memory: with one router alive it must count
 * exactly as the in-memory one.
 */
export type LeaseLedgerOptions = Omit<MemoryLeaseLedgerOptions, 'onUnread'>

export interface LeaseLedgerHarness {
  /** A ledger with these options on a fresh backing, closed when the case ends. */
  open(t: Test, opts: LeaseLedgerOptions): Promise<LeaseLedger>
}

async function setup(t: Test, harness: LeaseLedgerHarness, over: Partial<LeaseLedgerOptions> = {}) {
  const clock = new ManualClock()
  const registry = new Registry()
  const released: { ids: string[]; reason: LeaseEndReason }[] = []
  const ledger = await harness.open(t, {
    clock,
    leaseSeconds: 30,
    marginMs: 1000,
    retentionMs: 60_000,
    maxEntries: 1000,
    registry,
    onRelease: (leases, reason) => released.push({ ids: leases.map((l) => l.requestId), reason }),
    ...over,
  })
  let n = 0
  const lease = (o: Partial<HandoffLease> = {}): HandoffLease => {
    n++
    return { requestId: `r${n}`, clientRequestId: `c${n}`, prefill: 'p0', decode: 'd0', engineId: 'eng-p0', remoteRequestId: `cmpl-r${n}`, issuedAt: clock.now(), ...o }
  }
  return { clock, registry, ledger, released, lease }
}

async function metric(registry: Registry, name: string): Promise<string> {
  const text = await registry.metrics()
  return text
    .split('\n')
    .filter((l) => l.startsWith(name))
    .join('\n')
}

export function leaseLedgerContract(t: Test, harness: LeaseLedgerHarness): void {
  t.test('a lease goes issued → reading → done; the summary follows', async (t) => {
    const { clock, ledger, lease, released } = await setup(t, harness)
    const l = lease()
    ledger.issue(l)
    clock.advance(250)
    let s = await ledger.summary()
    t.same(s.inFlight, { issued: 1, reading: 0 })
    t.same(s.byPrefill, { p0: 1 })
    t.same(s.byDecode, { d0: 1 })
    t.equal(s.oldestAgeMs, 250)
    t.notOk('partial' in s, 'complete counts say nothing of it')
    t.equal(await ledger.unreadBy('p0'), 1)
    t.equal(await ledger.unreadBy('p1'), 0)
    ledger.reading(l.requestId)
    t.same((await ledger.summary()).inFlight, { issued: 0, reading: 1 })
    t.equal(await ledger.unreadBy('p0'), 1, 'being read is still unread')
    ledger.done(l.requestId)
    s = await ledger.summary()
    t.same(s.inFlight, { issued: 0, reading: 0 })
    t.equal(s.oldestAgeMs, null)
    t.equal(s.entries, 1, 'the ended entry is kept for retention')
    t.equal(await ledger.unreadBy('p0'), 0)
    t.same(released, [], 'a lease that was read is not released')
    // Later calls for an ended lease change nothing.
    ledger.release(l.requestId, 'client_gone')
    ledger.reading(l.requestId)
    ledger.done(l.requestId)
    t.same(released, [])
    t.same((await ledger.summary()).inFlight, { issued: 0, reading: 0 })
  })

  t.test('the lapse check: a lease within the margin of its expiry is never dispatched', async (t) => {
    const { clock, ledger, lease, released, registry } = await setup(t, harness)
    const l = lease()
    ledger.issue(l)
    clock.advance(28_999)
    t.notOk(ledger.lapsed(l.requestId), '1 ms before expiry − margin: still fine')
    clock.advance(1)
    t.ok(ledger.lapsed(l.requestId), 'at expiry − margin: lapsed')
    t.same(released, [{ ids: [l.requestId], reason: 'lapsed' }], "P's agent is told at once")
    t.notOk(ledger.lapsed(l.requestId), 'asked again: it is over, not lapsed twice')
    const s = await ledger.summary({ instance: 'p0' })
    t.same(s.lapsed, { beforeDispatch: 1, unread: 0, afterDispatch: 0 })
    t.same(s.released, { lapsed: 1 })
    t.same(s.leases, [])
    t.notOk(ledger.lapsed('unknown'), 'an unknown request id is not lapsed')
    t.match(await metric(registry, 'handoff_router_leases_lapsed_total'), /handoff_router_leases_lapsed_total\{when="before_dispatch"\} 1/)
  })

  t.test('releases: reasons are counted and each lease is released once', async (t) => {
    const { ledger, lease, released, registry } = await setup(t, harness)
    const a = lease()
    const b = lease({ remoteRequestId: undefined })
    const c = lease()
    for (const l of [a, b, c]) ledger.issue(l)
    // b's decoder refused the connection: it never got the params.
    ledger.reading(b.requestId)
    ledger.refused(b.requestId)
    t.equal(ledger.release(a.requestId, 'client_gone'), 'released')
    t.equal(ledger.release(a.requestId, 'router_error'), undefined, 'a second release is a no-op')
    t.equal(ledger.release(b.requestId, 'decode_failed'), 'released')
    t.equal(ledger.release(c.requestId, 'router_gone'), 'released')
    t.equal(ledger.release('unknown', 'client_gone'), undefined)
    t.same(released, [
      { ids: [a.requestId], reason: 'client_gone' },
      { ids: [b.requestId], reason: 'decode_failed' },
      { ids: [c.requestId], reason: 'router_gone' },
    ])
    t.same((await ledger.summary()).released, { client_gone: 1, decode_failed: 1, router_gone: 1 })
    const text = await metric(registry, 'handoff_router_leases_released_total')
    t.match(text, /reason="client_gone"\} 1/)
    t.match(text, /reason="decode_failed"\} 1/)
  })

  t.test('a lease handed to D is never released by the router: it is abandoned to P until P surely freed it', async (t) => {
    const { clock, ledger, lease, released, registry } = await setup(t, harness)
    const ended: LeaseRecord[] = []
    ledger.onEnded((l) => ended.push(l))
    const a = lease({ decode: 'd0' })
    const b = lease({ decode: 'd0' })
    const c = lease({ decode: 'd1' })
    for (const l of [a, b, c]) ledger.issue(l)
    for (const l of [a, b, c]) ledger.reading(l.requestId)
    clock.advance(10_000)
    // The client left, D's leg failed, the exchange broke: D may still be reading each one.
    t.equal(ledger.release(a.requestId, 'client_gone'), 'abandoned')
    t.equal(ledger.release(b.requestId, 'decode_failed'), 'abandoned')
    t.equal(ledger.release(b.requestId, 'router_error'), 'abandoned', 'again: still abandoned, counted once')
    t.same(released, [], "P's agent is told nothing: its lease (and D's heartbeats) decide")
    t.same(ended, [])
    let s = await ledger.summary({ instance: 'd0' })
    t.same(s.inFlight, { issued: 0, reading: 2 }, 'both still count as unread')
    t.same(s.abandoned, { client_gone: 1, decode_failed: 1 })
    t.match(s.leases, [
      { requestId: a.requestId, state: 'reading', abandonedAt: a.issuedAt + 10_000, reason: 'client_gone', expiresAt: a.issuedAt + 40_000 },
      { requestId: b.requestId, state: 'reading', abandonedAt: b.issuedAt + 10_000, reason: 'decode_failed' },
    ])
    t.equal(await ledger.unreadBy('p0'), 3, 'a drain of P waits for them')
    // Calls after the abandonment change nothing: only time ends it now.
    ledger.reading(a.requestId)
    ledger.refused(a.requestId)
    t.equal(ledger.release(a.requestId, 'client_gone'), 'abandoned')
    // One lease after the abandonment (past the original expiry too) P's lease is surely over.
    clock.advance(29_999)
    t.equal(await ledger.unreadBy('p0'), 3)
    clock.advance(1)
    t.equal(await ledger.unreadBy('p0'), 1, 'only c, still followed by its exchange, is left')
    t.same(
      ended.map((l) => [l.requestId, l.state, l.reason]),
      [
        [a.requestId, 'lapsed', 'client_gone'],
        [b.requestId, 'lapsed', 'decode_failed'],
      ],
    )
    t.same(released, [], 'never released')
    s = await ledger.summary()
    t.same(s.lapsed, { beforeDispatch: 0, unread: 0, afterDispatch: 2 })
    t.same(s.released, {})
    t.match(await metric(registry, 'handoff_router_leases_abandoned_total'), /reason="client_gone"\} 1/)
    t.match(await metric(registry, 'handoff_router_leases_lapsed_total'), /when="after_dispatch"\} 2/)
    // c's decoder answered after all: done, as ever.
    ledger.done(c.requestId)
    t.equal(await ledger.unreadBy('p0'), 0)
  })

  t.test('an abandoned lease of a long-lived issue keeps its original expiry when that is later', async (t) => {
    const { clock, ledger, lease } = await setup(t, harness, { leaseSeconds: 30 })
    const a = lease()
    ledger.issue(a)
    ledger.reading(a.requestId)
    // Abandoned at once: P's original expiry (30 s) and one lease from now (30 s) agree.
    ledger.release(a.requestId, 'client_gone')
    t.match((await ledger.summary({ instance: 'p0' })).leases, [{ expiresAt: a.issuedAt + 30_000 }])
    clock.advance(30_000)
    t.equal(await ledger.unreadBy('p0'), 0)
  })

  t.test('an issued lease past its expiry lapses by itself (counted, listeners told, P not told); one being read does not', async (t) => {
    const { clock, ledger, lease, released, registry } = await setup(t, harness)
    const ended: LeaseRecord[] = []
    const off = ledger.onEnded((l) => ended.push(l))
    const a = lease()
    ledger.issue(a)
    clock.advance(10_000)
    const b = lease()
    ledger.issue(b)
    const c = lease()
    ledger.issue(c)
    ledger.reading(c.requestId)
    clock.advance(20_000)
    t.equal(await ledger.unreadBy('p0'), 2, "a's 30 s are over; b has 10 s left; c is being read")
    t.same(
      ended.map((l) => [l.requestId, l.state]),
      [[a.requestId, 'lapsed']],
    )
    t.same(released, [], 'its blocks were freed by P itself')
    t.match(await metric(registry, 'handoff_router_leases{'), /handoff_router_leases\{state="issued"\} 1\nhandoff_router_leases\{state="reading"\} 1/)
    clock.advance(60_000)
    t.same((await ledger.summary()).lapsed, { beforeDispatch: 0, unread: 2, afterDispatch: 0 })
    // D's heartbeats extend a lease being read on P: it stays until D's first byte.
    t.equal(await ledger.unreadBy('p0'), 1)
    ledger.done(c.requestId)
    t.match(await metric(registry, 'handoff_router_leases{'), /handoff_router_leases\{state="reading"\} 0/)
    off()
    const last = lease()
    ledger.issue(last)
    ledger.release(last.requestId, 'client_gone')
    t.equal(ended.length, 3, 'an unsubscribed listener hears nothing more')
  })

  t.test('ended entries are pruned after the retention; the cap evicts ended ones first, then the oldest unread', async (t) => {
    const { clock, ledger, lease, registry } = await setup(t, harness, { retentionMs: 5000, maxEntries: 3 })
    const a = lease()
    ledger.issue(a)
    ledger.done(a.requestId)
    clock.advance(5000)
    t.equal((await ledger.summary()).entries, 0, 'pruned once its retention is over')

    const [x, y, z, w] = [lease(), lease(), lease(), lease()]
    ledger.issue(x)
    ledger.done(x.requestId)
    ledger.issue(y)
    ledger.issue(z)
    ledger.issue(w)
    t.equal((await ledger.summary()).entries, 3)
    t.same((await ledger.summary()).byPrefill, { p0: 3 }, 'the ended one went first')
    const v = lease()
    ledger.issue(v)
    t.equal((await ledger.summary()).entries, 3)
    t.equal(await ledger.unreadBy('p0'), 3)
    ledger.done(y.requestId)
    t.equal((await ledger.summary({ instance: 'p0' })).leases?.[0]?.requestId, z.requestId, 'y, the oldest unread, was evicted')
    const text = await metric(registry, 'handoff_router_lease_ledger_evictions_total')
    t.match(text, /kind="ended"\} 1/)
    t.match(text, /kind="unread"\} 1/)
  })

  t.test('a request id issued again replaces its entry; the instance filter lists its leases, oldest first', async (t) => {
    const { clock, ledger, lease } = await setup(t, harness)
    const a = lease()
    ledger.issue(a)
    ledger.issue({ ...a, prefill: 'p1', decode: 'd1' })
    t.equal((await ledger.summary()).entries, 1)
    ledger.issue(lease({ prefill: 'p0', decode: 'd2' }))
    clock.advance(10)
    const b = lease({ prefill: 'p2', decode: 'd1' })
    ledger.issue(b)
    ledger.reading(b.requestId)
    const s = await ledger.summary({ instance: 'd1' })
    t.same(s.byPrefill, { p1: 1, p2: 1 })
    t.same(s.inFlight, { issued: 1, reading: 1 })
    t.equal(s.oldestAgeMs, 10)
    t.match(s.leases, [
      { requestId: a.requestId, prefill: 'p1', decode: 'd1', state: 'issued', expiresAt: a.issuedAt + 30_000 },
      { requestId: b.requestId, prefill: 'p2', state: 'reading' },
    ])
    t.notOk('leases' in (await ledger.summary()), 'without a filter no list')
  })

  t.test('the instance filter lists at most 100 leases', async (t) => {
    const { clock, ledger, lease } = await setup(t, harness)
    const first = lease()
    ledger.issue(first)
    for (let i = 0; i < 120; i++) {
      clock.advance(1)
      ledger.issue(lease())
    }
    const s = await ledger.summary({ instance: 'p0' })
    t.equal(s.inFlight.issued, 121, 'all counted')
    t.equal(s.leases?.length, 100)
    t.equal(s.leases?.[0]?.requestId, first.requestId)
  })
}
