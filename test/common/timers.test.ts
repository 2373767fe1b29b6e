import t from 'tap'
import { ManualClock } from '../../common/clock.js'
import { every, sleep } from '../../common/timers.js'

const flush = async (): Promise<void> => {
  for (let i = 0; i < 5; i++) await Promise.resolve()
}

t.test('sleep waits on the injected clock and ends early on abort', async (t) => {
  const clock = new ManualClock()
  let done = false
  const p = sleep(clock, 100).then(() => {
    done = true
  })
  clock.advance(99)
  await flush()
  t.notOk(done)
  clock.advance(1)
  await p
  t.ok(done)
  await sleep(clock, 0)
  t.equal(clock.pendingTimers, 0, 'zero waits set no timer')

  const ac = new AbortController()
  const aborted = sleep(clock, 1000, ac.signal)
  ac.abort(new Error('client gone'))
  await t.rejects(aborted, { message: 'client gone' })
  t.equal(clock.pendingTimers, 0, 'the timer is cleared')
  await t.rejects(sleep(clock, 10, ac.signal), { message: 'client gone' }, 'already aborted')
})

t.test('every runs on the clock, never overlapping, until stopped', async (t) => {
  const clock = new ManualClock()
  let runs = 0
  const h = every(clock, 100, () => {
    runs++
  })
  clock.advance(99)
  t.equal(runs, 0, 'the first run is one interval from now')
  clock.advance(1)
  t.equal(runs, 1)
  clock.advance(250)
  t.equal(runs, 3)
  t.notOk(h.stopped)
  h.stop()
  t.ok(h.stopped)
  clock.advance(1000)
  t.equal(runs, 3)
  t.equal(clock.pendingTimers, 0)
  t.throws(() => every(clock, 0, () => {}), RangeError)

  // An async run delays the next one until it settles: no overlap.
  let active = 0
  let maxActive = 0
  const release: (() => void)[] = []
  const slow = every(clock, 10, async () => {
    active++
    maxActive = Math.max(maxActive, active)
    await new Promise<void>((r) => release.push(r))
    active--
  })
  clock.advance(10)
  t.equal(active, 1)
  clock.advance(100)
  t.equal(clock.pendingTimers, 0, 'nothing scheduled while a run is in progress')
  release.shift()?.()
  await flush()
  t.equal(clock.pendingTimers, 1, 'the next run is scheduled once the previous settled')
  clock.advance(10)
  t.equal(maxActive, 1)
  slow.stop()
  release.shift()?.()
  await flush()
  t.equal(clock.pendingTimers, 0, 'a run in progress at stop schedules none after it')
})

t.test('every: errors go to onError and the schedule goes on', async (t) => {
  const clock = new ManualClock()
  const errors: unknown[] = []
  let n = 0
  const h = every(
    clock,
    10,
    () => {
      n++
      if (n === 1) throw new Error('sync')
      if (n === 2) return Promise.reject(new Error('async'))
      return undefined
    },
    { onError: (err) => errors.push((err as Error).message) },
  )
  clock.advance(10)
  clock.advance(10)
  await flush()
  clock.advance(10)
  t.equal(n, 3)
  t.same(errors, ['sync', 'async'])
  h.stop()

  // Without onError a failed run throws, as a timer callback would.
  const bare = every(clock, 10, () => {
    throw new Error('loud')
  })
  t.throws(() => clock.advance(10), { message: 'loud' })
  bare.stop()
})
