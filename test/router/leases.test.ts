import t from 'tap'
import { ManualClock } from '../../common/clock.js'
import type { LeaseRecord } from '../../router/src/leases/ledger.js'
import { untrackedLedger } from '../../router/src/leases/ledger.js'
import { MemoryLeaseLedger } from '../../router/src/leases/memory-ledger.js'

// What only the in-memory ledger has: its option checks, its size, the change hook a mirror
// hangs on, and the untracked ledger. The lifecycle itself is the contract's
// (test/store/lease-ledger.contract.ts, run by test/store/memory-lease-ledger.test.ts).

const ok = { clock: new ManualClock(), leaseSeconds: 30, marginMs: 1000, retentionMs: 0, maxEntries: 1 }

t.test('bad options are refused in the constructor', async (t) => {
  const { clock } = ok
  t.throws(() => new MemoryLeaseLedger({ ...ok, leaseSeconds: 0 }), RangeError)
  t.throws(() => new MemoryLeaseLedger({ ...ok, marginMs: 30_000 }), RangeError)
  t.throws(() => new MemoryLeaseLedger({ ...ok, marginMs: -1 }), RangeError)
  t.throws(() => new MemoryLeaseLedger({ ...ok, retentionMs: -1 }), RangeError)
  t.throws(() => new MemoryLeaseLedger({ ...ok, maxEntries: 0 }), RangeError)
  const ledger = new MemoryLeaseLedger(ok)
  ledger.issue({ requestId: 'r', clientRequestId: 'c', prefill: 'p', decode: 'd', engineId: 'e', issuedAt: clock.now() })
  t.ok(ledger.lapsed('r') === false && (await ledger.summary()).entries === 1, 'no registry, no listener: still works')
  t.equal(ledger.size, 1)
})

t.test('onUnread: every change to the unread leases, in order; unread() copies them', async (t) => {
  const clock = new ManualClock()
  const seen: string[] = []
  const ledger = new MemoryLeaseLedger({ clock, leaseSeconds: 30, marginMs: 1000, retentionMs: 60_000, maxEntries: 2, onUnread: (change, l: LeaseRecord) => seen.push(`${change} ${l.requestId} ${l.state} ${l.decode}`) })
  const lease = (id: string) => ({ requestId: id, clientRequestId: id, prefill: 'p0', decode: 'd0', engineId: 'e', issuedAt: clock.now() })
  ledger.issue(lease('a'))
  ledger.redirect('a', 'd1')
  ledger.redirect('a', 'd1')
  ledger.reading('a')
  ledger.done('a')
  ledger.issue(lease('b'))
  ledger.issue(lease('b'))
  ledger.issue(lease('c'))
  ledger.issue(lease('d'))
  t.same(seen, [
    'set a issued d0',
    'set a issued d1',
    'set a reading d1',
    'delete a done d1',
    'set b issued d0',
    'delete b issued d0',
    'set b issued d0',
    'set c issued d0',
    'delete b issued d0',
    'set d issued d0',
  ], 'an unchanged redirect says nothing; a reissue and an eviction delete first')
  const unread = ledger.unread()
  t.same(
    unread.map((l) => l.requestId),
    ['c', 'd'],
  )
  unread[0]!.state = 'done'
  t.equal(ledger.unread()[0]?.state, 'issued', 'copies')
  seen.length = 0
  clock.advance(30_000)
  t.same(ledger.unread(), [])
  t.same(seen, ['delete c lapsed d0', 'delete d lapsed d0'], 'expiry deletes too')
})

t.test('the untracked ledger records nothing', async (t) => {
  untrackedLedger.issue({ requestId: 'r', clientRequestId: 'c', prefill: 'p', decode: 'd', engineId: 'e', issuedAt: 0 })
  t.notOk(untrackedLedger.lapsed('r'))
  t.equal(await untrackedLedger.unreadBy('p'), 0)
  t.equal((await untrackedLedger.summary()).entries, 0)
  untrackedLedger.redirect('r', 'd')
  untrackedLedger.reading('r')
  untrackedLedger.refused('r')
  untrackedLedger.done('r')
  t.equal(untrackedLedger.release('r', 'client_gone'), undefined)
  untrackedLedger.onEnded(() => {})()
})
