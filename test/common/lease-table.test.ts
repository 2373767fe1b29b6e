import t from 'tap'
import { ManualClock } from '../../common/clock.js'
import { LeaseTable, type LeaseEndReason } from '../../common/lease-table.js'

t.test('lease table', async (t) => {
  const clock = new ManualClock()
  const ended: [string, LeaseEndReason][] = []
  const leases = new LeaseTable<number[]>({ clock, leaseMs: 30_000, onEnd: (l, r) => ended.push([l.id, r]) })
  leases.pin('a', [1, 2])
  leases.pin('b', [3], 2)
  leases.pin('c', [4])
  leases.pin('d', [5])
  t.throws(() => leases.pin('a', [9]))
  t.equal(leases.expiresAtWall('a'), clock.now() + 30_000)
  t.equal(leases.expiresAtWall('zz'), undefined)
  t.ok(leases.readDone('a'))
  t.notOk(leases.readDone('a'), 'unknown id ignored')
  t.ok(leases.readDone('b'))
  t.ok(leases.get('b'), 'two consumers: still pinned after one read')
  t.ok(leases.readDone('b'))
  t.ok(leases.release('c'))
  t.notOk(leases.release('c'))
  t.same(ended, [['a', 'read_done'], ['b', 'read_done'], ['c', 'released']])

  // Heartbeats extend to now + 2/3 lease and never shorten.
  clock.advance(25_000)
  t.ok(leases.heartbeat('d'))
  t.equal(leases.get('d')?.deadline, 25_000 + 20_000)
  clock.advance(1_000)
  t.ok(leases.heartbeat('d'))
  t.equal(leases.get('d')?.deadline, 46_000)
  t.notOk(leases.heartbeat('nope'))
  clock.advance(19_999)
  t.equal(leases.reap(), 0)
  // The reaper scans everything: an expired lease behind a renewed one is still reaped.
  leases.pin('e', [6])
  leases.heartbeat('e')
  leases.pin('f', [7])
  clock.advance(1)
  t.equal(leases.reap(), 1)
  t.same(ended.at(-1), ['d', 'expired'])

  // The periodic reaper runs on the injected clock.
  leases.start()
  leases.start()
  clock.advance(30_000)
  t.equal(leases.size, 0)
  t.same(ended.slice(-2).map((e) => e[1]), ['expired', 'expired'])
  leases.stop()
  t.equal(clock.pendingTimers, 0)
  t.throws(() => new LeaseTable({ clock, leaseMs: 0, onEnd: () => {} }), RangeError)
})

t.test('a lease holds any value and hands it back when it ends', async (t) => {
  const clock = new ManualClock()
  const ended: { id: string; value: { agent: string }; reason: LeaseEndReason }[] = []
  const leases = new LeaseTable<{ agent: string }>({ clock, leaseMs: 1000, reapIntervalMs: 100, onEnd: (l, reason) => ended.push({ id: l.id, value: l.value, reason }) })
  t.equal(leases.leaseMs, 1000)
  const lease = leases.pin('r1', { agent: 'a1' })
  t.match(lease, { id: 'r1', value: { agent: 'a1' }, consumers: 1, issuedAt: 0, deadline: 1000, reads: 0 })
  leases.start()
  clock.advance(999)
  t.equal(leases.size, 1)
  clock.advance(101)
  t.same(ended, [{ id: 'r1', value: { agent: 'a1' }, reason: 'expired' }], 'reaped on the next pass after the deadline')
  leases.stop()
  leases.stop()
  t.equal(clock.pendingTimers, 0)
})
