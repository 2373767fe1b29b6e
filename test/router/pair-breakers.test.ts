import t from 'tap'
import { ManualClock } from '../../common/clock.js'
import { PairBreakers } from '../../router/src/topology/pair-breakers.js'

const policy = { failureThreshold: 3, openMs: 1000, maxOpenMs: 4000 }

t.test('consecutive failures open the pair, not its engines; a success resets the count', async (t) => {
  const clock = new ManualClock()
  const opened: string[] = []
  const b = new PairBreakers({ clock, policy, onOpen: (p, d) => opened.push(`${p}>${d}`) })
  b.recordFailure('p0', 'd0')
  b.recordFailure('p0', 'd0')
  b.recordSuccess('p0', 'd0')
  b.recordFailure('p0', 'd0')
  b.recordFailure('p0', 'd0')
  t.equal(b.state('p0', 'd0'), 'closed', 'a success in between resets the count')
  b.recordFailure('p0', 'd0')
  t.equal(b.state('p0', 'd0'), 'open')
  t.ok(b.blocked('p0', 'd0'))
  t.notOk(b.blocked('p0', 'd1'), 'p0 still pairs with d1')
  t.notOk(b.blocked('p1', 'd0'), 'd0 still pairs with p1')
  t.same(opened, ['p0>d0'])
  t.match(b.list(), [{ prefill: 'p0', decode: 'd0', state: 'open', failures: 3, retryInMs: 1000 }])
})

t.test('half-open: one trial at a time; failure doubles the rest up to the cap, success closes', async (t) => {
  const clock = new ManualClock()
  const b = new PairBreakers({ clock, policy })
  for (let i = 0; i < 3; i++) b.recordFailure('p', 'd')
  clock.advance(999)
  t.ok(b.blocked('p', 'd'))
  clock.advance(1)
  t.equal(b.state('p', 'd'), 'half_open')
  t.notOk(b.blocked('p', 'd'), 'a trial may go')
  b.chosen('p', 'd')
  t.ok(b.blocked('p', 'd'), 'only one trial in flight')
  b.recordFailure('p', 'd')
  t.equal(b.state('p', 'd'), 'open')
  clock.advance(1999)
  t.ok(b.blocked('p', 'd'), 'open twice as long after a failed trial')
  clock.advance(1)
  b.chosen('p', 'd')
  b.recordFailure('p', 'd')
  clock.advance(4000)
  b.chosen('p', 'd')
  b.recordFailure('p', 'd')
  t.match(b.list(), [{ retryInMs: 4000 }], 'capped at maxOpenMs')
  clock.advance(4000)
  b.chosen('p', 'd')
  b.recordSuccess('p', 'd')
  t.equal(b.state('p', 'd'), 'closed')
  t.same(b.list(), [])
})

t.test('forget drops every pair of an instance', async (t) => {
  const clock = new ManualClock()
  const b = new PairBreakers({ clock, policy: { ...policy, failureThreshold: 1 } })
  b.recordFailure('p0', 'd0')
  b.recordFailure('p1', 'd0')
  b.recordFailure('p1', 'd1')
  b.forget('d0')
  t.same(b.list().map((p) => `${p.prefill}>${p.decode}`), ['p1>d1'])
  t.throws(() => new PairBreakers({ clock, policy: { ...policy, failureThreshold: 0 } }), RangeError)
})
