import { Registry } from 'prom-client'
import t from 'tap'
import { ManualClock } from '../../common/clock.js'
import type { HandoffLease, LeaseEndReason, LeaseRecord } from '../../router/src/leases/ledger.js'
import { untrackedLedger } from '../../router/src/leases/ledger.js'
import { MemoryLeaseLedger, type MemoryLeaseLedgerOptions } from '../../router/src/leases/memory-ledger.js'

// The in-memory lease ledger on a hand-driven clock: lifecycle, the lapse check before the
// decode leg, releases (and what P's agent is told), expiry, retention, the cap, metrics.

function setup(over: Partial<MemoryLeaseLedgerOptions> = {}) {
  const clock = new ManualClock()
  const registry = new Registry()
  const released: { ids: string[]; reason: LeaseEndReason }[] = []
  const ledger = new MemoryLeaseLedger({
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

t.test('a lease goes issued → reading → done; the summary follows', async (t) => {
  const { clock, ledger, lease, released } = setup()
  const l = lease()
  ledger.issue(l)
  clock.advance(250)
  let s = ledger.summary()
  t.same(s.inFlight, { issued: 1, reading: 0 })
  t.same(s.byPrefill, { p0: 1 })
  t.same(s.byDecode, { d0: 1 })
  t.equal(s.oldestAgeMs, 250)
  t.equal(ledger.unreadBy('p0'), 1)
  ledger.reading(l.requestId)
  t.same(ledger.summary().inFlight, { issued: 0, reading: 1 })
  ledger.done(l.requestId)
  s = ledger.summary()
  t.same(s.inFlight, { issued: 0, reading: 0 })
  t.equal(s.oldestAgeMs, null)
  t.equal(s.entries, 1, 'the ended entry is kept for retention')
  t.equal(ledger.unreadBy('p0'), 0)
  t.same(released, [], 'a lease that was read is not released')
  // Later calls for an ended lease change nothing.
  ledger.release(l.requestId, 'client_gone')
  ledger.reading(l.requestId)
  t.same(released, [])
  t.same(ledger.summary().inFlight, { issued: 0, reading: 0 })
})

t.test('the lapse check: a lease within the margin of its expiry is never dispatched', async (t) => {
  const { clock, ledger, lease, released, registry } = setup()
  const l = lease()
  ledger.issue(l)
  clock.advance(28_999)
  t.notOk(ledger.lapsed(l.requestId), '1 ms before expiry − margin: still fine')
  clock.advance(1)
  t.ok(ledger.lapsed(l.requestId), 'at expiry − margin: lapsed')
  t.same(released, [{ ids: [l.requestId], reason: 'lapsed' }], "P's agent is told at once")
  t.notOk(ledger.lapsed(l.requestId), 'asked again: it is over, not lapsed twice')
  const s = ledger.summary({ instance: 'p0' })
  t.same(s.lapsed, { beforeDispatch: 1, unread: 0 })
  t.same(s.released, { lapsed: 1 })
  t.same(s.leases, [])
  t.notOk(ledger.lapsed('unknown'), 'an unknown request id is not lapsed')
  t.match(await metric(registry, 'handoff_router_leases_lapsed_total'), /handoff_router_leases_lapsed_total\{when="before_dispatch"\} 1/)
})

t.test('releases: reasons are counted and each lease is released once', async (t) => {
  const { ledger, lease, released, registry } = setup()
  const a = lease()
  const b = lease({ remoteRequestId: undefined })
  ledger.issue(a)
  ledger.issue(b)
  ledger.reading(b.requestId)
  ledger.release(a.requestId, 'client_gone')
  ledger.release(a.requestId, 'router_error')
  ledger.release(b.requestId, 'decode_failed')
  ledger.release('unknown', 'client_gone')
  t.same(released, [
    { ids: [a.requestId], reason: 'client_gone' },
    { ids: [b.requestId], reason: 'decode_failed' },
  ])
  t.same(ledger.summary().released, { client_gone: 1, decode_failed: 1 })
  const text = await metric(registry, 'handoff_router_leases_released_total')
  t.match(text, /reason="client_gone"\} 1/)
  t.match(text, /reason="decode_failed"\} 1/)
})

t.test('a decoder that is gone: its unread leases (issued or reading) are released, others kept', async (t) => {
  const { ledger, lease, released } = setup()
  const a = lease({ decode: 'd0' })
  const b = lease({ decode: 'd0' })
  const c = lease({ decode: 'd1' })
  const done = lease({ decode: 'd0' })
  for (const l of [a, b, c, done]) ledger.issue(l)
  ledger.reading(b.requestId)
  ledger.done(done.requestId)
  // A refused connection moves c's params to d0: it is d0's lease now.
  ledger.redirect(c.requestId, 'd0')
  t.same(ledger.summary().byDecode, { d0: 3 })
  t.equal(ledger.releaseDecoder('d0', 'decoder_gone'), 3)
  t.same(released, [{ ids: [a.requestId, b.requestId, c.requestId], reason: 'decoder_gone' }], 'one call for the batch')
  t.equal(ledger.releaseDecoder('d0', 'decoder_gone'), 0)
  t.equal(ledger.releaseDecoder('d9', 'decoder_gone'), 0)
  ledger.redirect('unknown', 'd1')
  t.equal(ledger.unreadBy('p0'), 0)
})

t.test('an issued lease past its expiry lapses by itself (counted, listeners told, P not told); one being read does not', async (t) => {
  const { clock, ledger, lease, released, registry } = setup()
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
  t.equal(ledger.unreadBy('p0'), 2, "a's 30 s are over; b has 10 s left; c is being read")
  t.same(
    ended.map((l) => [l.requestId, l.state]),
    [[a.requestId, 'lapsed']],
  )
  t.same(released, [], 'its blocks were freed by P itself')
  t.match(await metric(registry, 'handoff_router_leases{'), /handoff_router_leases\{state="issued"\} 1\nhandoff_router_leases\{state="reading"\} 1/)
  clock.advance(60_000)
  t.same(ledger.summary().lapsed, { beforeDispatch: 0, unread: 2 })
  // D's heartbeats extend a lease being read on P: it stays until D's first byte.
  t.equal(ledger.unreadBy('p0'), 1)
  ledger.done(c.requestId)
  t.match(await metric(registry, 'handoff_router_leases{'), /handoff_router_leases\{state="reading"\} 0/)
  off()
  ledger.issue(lease())
  ledger.releaseDecoder('d0', 'decoder_gone')
  t.equal(ended.length, 3, 'an unsubscribed listener hears nothing more')
})

t.test('ended entries are pruned after the retention; the cap evicts ended ones first, then the oldest unread', async (t) => {
  const { clock, ledger, lease, registry } = setup({ retentionMs: 5000, maxEntries: 3 })
  const a = lease()
  ledger.issue(a)
  ledger.done(a.requestId)
  clock.advance(5000)
  t.equal(ledger.summary().entries, 0, 'pruned once its retention is over')

  const [x, y, z, w] = [lease(), lease(), lease(), lease()]
  ledger.issue(x)
  ledger.done(x.requestId)
  ledger.issue(y)
  ledger.issue(z)
  ledger.issue(w)
  t.equal(ledger.size, 3)
  t.same(ledger.summary().byPrefill, { p0: 3 }, 'the ended one went first')
  const v = lease()
  ledger.issue(v)
  t.equal(ledger.size, 3)
  t.equal(ledger.unreadBy('p0'), 3)
  ledger.done(y.requestId)
  t.equal(ledger.summary({ instance: 'p0' }).leases?.[0]?.requestId, z.requestId, 'y, the oldest unread, was evicted')
  const text = await metric(registry, 'handoff_router_lease_ledger_evictions_total')
  t.match(text, /kind="ended"\} 1/)
  t.match(text, /kind="unread"\} 1/)
})

t.test('a request id issued again replaces its entry; the instance filter lists its leases', async (t) => {
  const { ledger, lease } = setup()
  const a = lease()
  ledger.issue(a)
  ledger.issue({ ...a, prefill: 'p1', decode: 'd1' })
  t.equal(ledger.size, 1)
  ledger.issue(lease({ prefill: 'p0', decode: 'd2' }))
  const s = ledger.summary({ instance: 'd1' })
  t.same(s.byPrefill, { p1: 1 })
  t.match(s.leases, [{ requestId: a.requestId, prefill: 'p1', decode: 'd1', state: 'issued', expiresAt: a.issuedAt + 30_000 }])
  t.notOk('leases' in ledger.summary(), 'without a filter no list')
})

t.test('bad options are refused in the constructor', async (t) => {
  const clock = new ManualClock()
  const ok = { clock, leaseSeconds: 30, marginMs: 1000, retentionMs: 0, maxEntries: 1 }
  t.throws(() => new MemoryLeaseLedger({ ...ok, leaseSeconds: 0 }), RangeError)
  t.throws(() => new MemoryLeaseLedger({ ...ok, marginMs: 30_000 }), RangeError)
  t.throws(() => new MemoryLeaseLedger({ ...ok, marginMs: -1 }), RangeError)
  t.throws(() => new MemoryLeaseLedger({ ...ok, retentionMs: -1 }), RangeError)
  t.throws(() => new MemoryLeaseLedger({ ...ok, maxEntries: 0 }), RangeError)
  const ledger = new MemoryLeaseLedger(ok)
  ledger.issue({ requestId: 'r', clientRequestId: 'c', prefill: 'p', decode: 'd', engineId: 'e', issuedAt: clock.now() })
  t.ok(ledger.lapsed('r') === false && ledger.summary().entries === 1, 'no registry, no listener: still works')
})

t.test('the untracked ledger records nothing', async (t) => {
  untrackedLedger.issue({ requestId: 'r', clientRequestId: 'c', prefill: 'p', decode: 'd', engineId: 'e', issuedAt: 0 })
  t.notOk(untrackedLedger.lapsed('r'))
  t.equal(untrackedLedger.unreadBy('p'), 0)
  t.equal(untrackedLedger.releaseDecoder('d', 'decoder_gone'), 0)
  t.equal(untrackedLedger.summary().entries, 0)
  untrackedLedger.onEnded(() => {})()
})
