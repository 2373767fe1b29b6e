import t from 'tap'
import { ManualClock } from '../../common/clock.js'
import { TopologyRegistry } from '../../router/src/topology/registry.js'

const policy = { unhealthyThreshold: 2, baseEjectionMs: 1000, maxEjectionMs: 3000 }

function registry(clock = new ManualClock()) {
  return {
    clock,
    reg: new TopologyRegistry({
      clock,
      policy,
      instances: [
        { id: 'p', role: 'prefill', url: 'http://127.0.0.1:1001/ignored' },
        { id: 'd', role: 'decode', url: 'http://127.0.0.1:1002' },
      ],
    }),
  }
}

t.test('consecutive failures eject, with a doubling ejection capped at the maximum', async (t) => {
  const { clock, reg } = registry()
  t.ok(reg.isUp('d'))
  reg.recordFailure('d')
  t.ok(reg.isUp('d'), 'one failure is below the threshold')
  reg.recordFailure('d')
  t.notOk(reg.isUp('d'), 'ejected at the threshold')
  t.notOk(reg.snapshot().instances.find((i) => i.id === 'd')?.healthy)
  clock.advance(999)
  t.notOk(reg.isUp('d'))
  clock.advance(1)
  t.ok(reg.isUp('d'), 'back after 1 s')
  t.ok(reg.snapshot().instances.find((i) => i.id === 'd')?.healthy, 'snapshot sees the expiry')
  reg.recordFailure('d')
  reg.recordFailure('d')
  clock.advance(1999)
  t.notOk(reg.isUp('d'), 'second ejection lasts 2 s')
  clock.advance(1)
  reg.recordFailure('d')
  reg.recordFailure('d')
  clock.advance(2999)
  t.notOk(reg.isUp('d'), 'third is capped at 3 s')
  clock.advance(1)
  t.ok(reg.isUp('d'))
})

t.test('a success resets the failure streak', async (t) => {
  const { reg } = registry()
  reg.recordFailure('d')
  reg.recordSuccess('d')
  reg.recordFailure('d')
  t.ok(reg.isUp('d'))
})

t.test('a failure while the instance answered others is excused: busy, not gone (issue 37 item 5)', async (t) => {
  const { reg } = registry()
  const busy: string[] = []
  reg.subscribe((c) => {
    if (c.type === 'busy') busy.push(c.check)
  })
  reg.recordProbe('d', true)
  // Connect failures: each request's mark taken when it went out, answers heard meanwhile.
  for (let i = 0; i < 5; i++) {
    const mark = reg.answers('d')
    reg.recordSuccess('d', 200)
    reg.recordFailure('d', mark)
  }
  t.ok(reg.isUp('d'), 'five connect failures while it answered do not eject it')
  // Probes without an answer, likewise.
  for (let i = 0; i < 5; i++) {
    const mark = reg.answers('d')
    reg.recordSuccess('d', 200)
    reg.recordProbe('d', false, undefined, false, mark)
  }
  t.ok(reg.isUp('d'), 'five late probes while it answered do not mark it down')
  t.same(busy, [...Array(5).fill('connect'), ...Array(5).fill('probe')])
  // Errors are not evidence: an engine that answers only 5xx gets no excuse.
  for (let i = 0; i < 2; i++) {
    const mark = reg.answers('d')
    reg.recordSuccess('d', 503)
    reg.recordProbe('d', false, undefined, false, mark)
  }
  t.notOk(reg.isUp('d'), 'late probes while it answered only 503s count')
  reg.recordProbe('d', true)
  // Nothing heard since the mark: counted as before.
  const mark = reg.answers('d')
  reg.recordFailure('d', mark)
  reg.recordFailure('d', mark)
  t.notOk(reg.isUp('d'), 'connect failures with nothing heard eject it')
})

t.test('probes mark instances down and up, and a passing probe ends an ejection', async (t) => {
  const { reg } = registry()
  reg.recordProbe('p', false)
  t.notOk(reg.isUp('p'))
  t.ok(reg.needsModels('p'))
  reg.recordProbe('p', true, ['m1', 'm2'])
  t.ok(reg.isUp('p'))
  t.notOk(reg.needsModels('p'))
  t.same([...reg.snapshot().models].sort(), ['m1', 'm2'])
})

t.test('inflight counts feed the snapshot and never go negative', async (t) => {
  const { reg } = registry()
  reg.acquire('d')
  reg.acquire('d')
  t.equal(reg.snapshot().instances.find((i) => i.id === 'd')?.inflight, 2)
  reg.release('d')
  reg.release('d')
  reg.release('d')
  t.equal(reg.snapshot().instances.find((i) => i.id === 'd')?.inflight, 0)
})

t.test('a new engine_id at a known address reports the old one', async (t) => {
  const { reg } = registry()
  t.equal(reg.observeEngineId('p', 'e1'), undefined, 'first sighting is no change')
  t.equal(reg.observeEngineId('p', 'e1'), undefined)
  t.same(reg.observeEngineId('p', 'e2'), { instanceId: 'p', address: '127.0.0.1:1001', previous: 'e1', current: 'e2' })
  t.equal(reg.snapshot().instances.find((i) => i.id === 'p')?.engineId, 'e2')
  t.equal(reg.url('p'), 'http://127.0.0.1:1001', 'urls are normalised to their origin')
})

t.test('bad input is rejected', async (t) => {
  const clock = new ManualClock()
  t.throws(() => new TopologyRegistry({ clock, policy: { ...policy, unhealthyThreshold: 0 }, instances: [] }), RangeError)
  const { reg } = registry()
  t.throws(() => reg.add({ id: 'p', role: 'prefill', url: 'http://127.0.0.1:1' }), /duplicate/)
  t.throws(() => reg.acquire('nope'), /unknown instance/)
})

t.test('an instance that was up goes down only after unhealthyThreshold failed probes in a row', async (t) => {
  const { reg } = registry()
  const changes: string[] = []
  reg.subscribe((c) => changes.push(`${c.type}:${c.instanceId}`))
  reg.recordProbe('d', true)
  reg.recordProbe('d', false)
  t.ok(reg.isUp('d'), 'one lost probe (a busy moment) is not an outage')
  reg.recordProbe('d', true)
  reg.recordProbe('d', false)
  t.ok(reg.isUp('d'), 'the streak restarted')
  reg.recordProbe('d', false)
  t.notOk(reg.isUp('d'), 'two in a row (the threshold) mark it down')
  reg.recordProbe('d', false)
  reg.recordProbe('d', true)
  t.same(changes, ['up:d', 'down:d', 'up:d'], 'subscribers hear each transition once')
  reg.recordProbe('p', false)
  t.notOk(reg.isUp('p'), 'an instance never seen up is down at its first failed probe')
})

t.test('a passing probe ends an ejection; the backoff starts over after a quiet period', async (t) => {
  const { clock, reg } = registry()
  const changes: string[] = []
  reg.subscribe((c) => changes.push(c.type === 'ejected' ? `ejected:${c.forMs}` : c.type))
  reg.recordProbe('d', true)
  reg.recordFailure('d')
  reg.recordFailure('d')
  t.notOk(reg.isUp('d'), 'ejected')
  reg.recordProbe('d', true)
  t.ok(reg.isUp('d'), 'the instance serves again: forgiven')
  reg.recordFailure('d')
  reg.recordFailure('d')
  clock.advance(100)
  reg.recordProbe('d', true)
  reg.recordFailure('d')
  reg.recordFailure('d')
  clock.advance(10_000)
  reg.recordFailure('d')
  reg.recordFailure('d')
  t.same(changes, ['up', 'ejected:1000', 'up', 'ejected:2000', 'up', 'ejected:3000', 'ejected:1000'], 'doubling while close together, then from the start')
})

t.test('draining stops new work and says when the last request left', async (t) => {
  const { reg } = registry()
  const changes: string[] = []
  reg.subscribe((c) => c.type !== 'released' && changes.push(c.type))
  reg.acquire('d')
  reg.drain('d')
  reg.drain('d')
  t.notOk(reg.isUp('d'))
  t.equal(reg.snapshot().instances.find((i) => i.id === 'd')?.draining, true)
  reg.release('d')
  t.same(changes, ['draining', 'drained'])
})

t.test('the first engine_id and a change of it are told to subscribers', async (t) => {
  const { reg } = registry()
  const changes: unknown[] = []
  const off = reg.subscribe((c) => changes.push(c))
  reg.observeEngineId('p', 'e1')
  reg.observeEngineId('p', 'e2')
  off()
  reg.observeEngineId('p', 'e3')
  t.same(changes, [
    { type: 'engine_id_learned', instanceId: 'p', engineId: 'e1' },
    { type: 'engine_id_changed', instanceId: 'p', address: '127.0.0.1:1001', previous: 'e1', current: 'e2' },
  ])
})

t.test('instances join and leave at runtime; late reports for a removed one are no-ops', async (t) => {
  const { reg } = registry()
  const changes: string[] = []
  reg.subscribe((c) => changes.push(`${c.type}:${c.instanceId}`))
  const before = reg.snapshot()
  reg.add({ id: 'd2', role: 'decode', url: 'http://127.0.0.1:1003' })
  t.throws(() => reg.add({ id: 'd2', role: 'decode', url: 'http://127.0.0.1:1004' }), /duplicate/)
  const after = reg.snapshot()
  t.not(after, before, 'a join invalidates the cached snapshot')
  t.match(
    after.instances.find((i) => i.id === 'd2'),
    { role: 'decode', healthy: true, inflight: 0 },
  )
  t.ok(reg.has('d2') && reg.isUp('d2'))
  reg.acquire('d2')
  t.ok(reg.remove('d2'))
  t.notOk(reg.remove('d2'), 'removing twice: false')
  t.notOk(reg.has('d2'))
  t.notOk(reg.snapshot().instances.some((i) => i.id === 'd2'))
  // Work that was in flight on it, probes and passive outcomes that come back later.
  reg.release('d2')
  reg.recordSuccess('d2')
  reg.recordFailure('d2')
  reg.recordProbe('d2', false)
  t.notOk(reg.isUp('d2'))
  t.notOk(reg.needsModels('d2'), 'a removed instance is not asked for its models')
  t.equal(reg.observeEngineId('d2', 'e'), undefined)
  t.same(changes, ['added:d2', 'removed:d2'])
})
