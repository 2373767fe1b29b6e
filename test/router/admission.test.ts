import { Gauge, Histogram, Registry } from 'prom-client'
import t from 'tap'
import { ManualClock } from '../../common/clock.js'
import { seededRandom } from '../../common/random.js'
import { Admission } from '../../router/src/admission/admission.js'
import { TopologyRegistry } from '../../router/src/topology/registry.js'

// The admission queue on a fake clock: FIFO, bounded, timed, and woken by the registry.
function setup(opts: { cap?: number; queueLength?: number; queueTimeoutMs?: number } = {}) {
  const clock = new ManualClock()
  const registry = new TopologyRegistry({
    clock,
    policy: { unhealthyThreshold: 2, baseEjectionMs: 1000, maxEjectionMs: 4000 },
    instances: [{ id: 'b', role: 'both', url: 'http://127.0.0.1:1' }],
    limit: opts.cap ?? 1,
  })
  const reg = new Registry()
  const admission = new Admission({
    registry,
    clock,
    random: seededRandom(1),
    queueLength: opts.queueLength ?? 2,
    queueTimeoutMs: opts.queueTimeoutMs ?? 1000,
    retryAfterSeconds: 3,
    metrics: {
      queueDepth: new Gauge({ name: 'depth', help: 'h', registers: [reg] }),
      queueWait: new Histogram({ name: 'wait', help: 'h', registers: [reg] }),
    },
  })
  const req = (signal = new AbortController().signal) => ({ model: 'm', signal, onMode: () => {} })
  return { clock, registry, admission, req }
}

t.test('waiters are admitted in order as slots free up', async (t) => {
  const { registry, admission, req } = setup()
  await admission.admit(req())
  const order: number[] = []
  const waits = [1, 2].map((n) => admission.admit(req()).then(() => order.push(n)))
  t.equal(admission.queued, 2)
  registry.release('b')
  await waits[0]
  t.same(order, [1])
  registry.release('b')
  await waits[1]
  t.same(order, [1, 2])
})

t.test('a full queue and a wait that runs out are 429s with Retry-After', async (t) => {
  const { clock, admission, req } = setup({ queueLength: 1 })
  await admission.admit(req())
  const waiting = admission.admit(req())
  await t.rejects(admission.admit(req()), { code: 'RTR_ERR_OVERLOADED', statusCode: 429, retryAfterSeconds: 3 })
  clock.advance(1000)
  await t.rejects(waiting, { code: 'RTR_ERR_OVERLOADED', message: /no slot freed within 1000 ms/ })
  t.equal(admission.queued, 0)
})

t.test('a client that leaves while queued gives up its place', async (t) => {
  const { registry, admission, req } = setup()
  await admission.admit(req())
  const ac = new AbortController()
  const leaving = admission.admit(req(ac.signal))
  const staying = admission.admit(req())
  ac.abort(new Error('gone'))
  await t.rejects(leaving, /gone/)
  registry.release('b')
  await staying
  t.pass('the next in line got the slot')
})

t.test('an instance that goes down while requests wait: they are refused with 503 when woken', async (t) => {
  const { registry, admission, req } = setup()
  await admission.admit(req())
  const waiting = admission.admit(req())
  registry.recordProbe('b', false)
  registry.release('b')
  await t.rejects(waiting, { code: 'RTR_ERR_NO_INSTANCE' })
})

t.test('closing refuses every waiter', async (t) => {
  const { admission, req } = setup()
  await admission.admit(req())
  const waiting = admission.admit(req())
  admission.close()
  await t.rejects(waiting, { code: 'RTR_ERR_OVERLOADED', message: /closing/ })
  t.throws(() => setup({ cap: 0 }), RangeError)
})
