import pino from 'pino'
import { Counter, Gauge, Histogram, Registry } from 'prom-client'
import t from 'tap'
import { ManualClock } from '../../common/clock.js'
import { seededRandom } from '../../common/random.js'
import { AdaptiveLimits, type LimitPolicy } from '../../router/src/admission/adaptive-limits.js'
import { Admission } from '../../router/src/admission/admission.js'
import { parseEngineLoad } from '../../router/src/admission/engine-load.js'
import type { HttpGet } from '../../router/src/topology/prober.js'
import { TopologyRegistry } from '../../router/src/topology/registry.js'

// The adaptive limit's policy on a fake clock: what an engine reports moves one instance's
// limit, and the registry's candidate lists and the admission queue follow.

const POLICY: LimitPolicy = { mode: 'adaptive', min: 2, max: 64, sampleIntervalMs: 500, engineQueue: 2, firstTokenTolerance: 2 }

/** vLLM 0.32's lines for the two gauges (one data-parallel rank), among others. */
function vllmMetrics(running: number, waiting: number, ranks = 1): string {
  const lines = ['# HELP vllm:num_requests_running Number of requests in model execution batches.', '# TYPE vllm:num_requests_running gauge']
  for (let r = 0; r < ranks; r++) lines.push(`vllm:num_requests_running{engine="${r}",model_name="Qwen/Qwen3-0.6B"} ${running / ranks}`)
  lines.push('# HELP vllm:num_requests_waiting Number of requests waiting to be processed.', '# TYPE vllm:num_requests_waiting gauge')
  for (let r = 0; r < ranks; r++) lines.push(`vllm:num_requests_waiting{engine="${r}",model_name="Qwen/Qwen3-0.6B"} ${waiting / ranks}`)
  lines.push('vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 99.0', 'vllm:kv_cache_usage_perc{engine="0"} 0.5')
  return `${lines.join('\n')}\n`
}

function setup(policy: Partial<LimitPolicy> = {}, answer: () => { status: number; text: string } = () => ({ status: 404, text: '' }), queued = () => 0) {
  const clock = new ManualClock()
  const registry = new TopologyRegistry({
    clock,
    policy: { unhealthyThreshold: 2, baseEjectionMs: 1000, maxEjectionMs: 4000 },
    instances: [{ id: 'd', role: 'both', url: 'http://127.0.0.1:1' }],
    limit: 10,
  })
  const reg = new Registry()
  const gets: string[] = []
  const get: HttpGet = async (url) => {
    gets.push(url)
    return answer()
  }
  const limits = new AdaptiveLimits({
    registry,
    get,
    clock,
    log: pino({ level: 'silent' }),
    policy: { ...POLICY, ...policy },
    timeoutMs: 100,
    queued,
    metrics: {
      limit: new Gauge({ name: 'limit', help: 'h', labelNames: ['instance'], registers: [reg] }),
      changes: new Counter({ name: 'changes', help: 'h', labelNames: ['direction'], registers: [reg] }),
      samples: new Counter({ name: 'samples', help: 'h', labelNames: ['outcome'], registers: [reg] }),
    },
  })
  t.teardown(() => limits.close())
  const fill = (n: number): void => {
    for (let i = 0; i < n; i++) registry.acquire('d')
  }
  const limit = (): number => registry.load('d')?.limit ?? -1
  return { clock, registry, limits, fill, limit, gets, reg }
}

t.test('parseEngineLoad reads the two gauges, summed over ranks, and nothing that only starts like them', async (t) => {
  t.same(parseEngineLoad(vllmMetrics(12, 3)), { running: 12, waiting: 3 })
  t.same(parseEngineLoad(vllmMetrics(12, 4, 2)), { running: 12, waiting: 4 }, 'two data-parallel ranks add up')
  t.same(parseEngineLoad('vllm:num_requests_running 5\nvllm:num_requests_waiting 0'), { running: 5, waiting: 0 }, 'no labels, no trailing newline')
  t.same(parseEngineLoad('vllm:num_requests_running{a="x y}"} 5 1700000000\nvllm:num_requests_waiting{} 1'), { running: 5, waiting: 1 }, 'a brace inside a label value, a timestamp after the value')
  t.equal(parseEngineLoad('vllm:num_requests_running 5\n'), undefined, 'one gauge missing: not an engine that says')
  t.equal(parseEngineLoad('<html>not found</html>'), undefined)
})

t.test('an engine that queues more than engineQueue brings the limit down to what it runs plus engineQueue', async (t) => {
  const { limits, fill, limit } = setup()
  fill(10)
  limits.adjust('d', { running: 4, waiting: 6 })
  t.equal(limit(), 6, 'alone on the engine: the 4 it runs and the 2 it may queue')
  limits.adjust('d', { running: 4, waiting: 6 })
  t.equal(limit(), 6, 'the requests it still queues from before the cut do not count twice')
  limits.adjust('d', { running: 4, waiting: 2 })
  t.equal(limit(), 6, 'a queue within engineQueue holds the limit where it is')
})

t.test('several routers on one engine back off by their share of its queue', async (t) => {
  const { limits, fill, limit } = setup()
  fill(10)
  // The engine holds 40 (this router's 10 and another's 30) and runs 30: a quarter of 30 + 2 is ours.
  limits.adjust('d', { running: 30, waiting: 10 })
  t.equal(limit(), 8)
})

t.test('an engine with an empty queue raises a limit that binds, by 10 %, up to max', async (t) => {
  const { limits, fill, limit } = setup({ max: 12 })
  fill(5)
  limits.adjust('d', { running: 5, waiting: 0 })
  t.equal(limit(), 10, 'at half the limit nothing binds: unchanged')
  fill(4)
  limits.adjust('d', { running: 9, waiting: 0 })
  t.equal(limit(), 11, 'at 90 %: up by 10 % (at least 1)')
  fill(2)
  limits.adjust('d', { running: 11, waiting: 0 })
  limits.adjust('d', { running: 11, waiting: 0 })
  t.equal(limit(), 12, 'never past max')
  limits.adjust('d', { running: 11, waiting: 1 })
  t.equal(limit(), 12, 'a queue of one is neither empty nor over engineQueue: held')
})

t.test('a burst waiting in the router is let through in one raise when the engine has room', async (t) => {
  let queued = 30
  const { limits, fill, limit } = setup({}, undefined, () => queued)
  fill(10)
  limits.adjust('d', { running: 10, waiting: 0 })
  t.equal(limit(), 40, '30 waiting: up by 30, not by 10 %')
  queued = 0
  fill(30)
  limits.adjust('d', { running: 40, waiting: 0 })
  t.equal(limit(), 44, 'none waiting: 10 %')
  limits.adjust('d', { running: 20, waiting: 24 })
  t.equal(limit(), 20, 'the engine queued while running 20 (this router holds 40 of its 44: 40/44 of 20 + 2)')
  queued = 30
  limits.adjust('d', { running: 20, waiting: 0 })
  t.equal(limit(), 22, 'with 30 waiting, the raise stops where the engine was full (20 + engineQueue 2), not at 50')
})

t.test('the limit never goes below min', async (t) => {
  const { limits, fill, limit } = setup()
  fill(3)
  limits.adjust('d', { running: 3, waiting: 50 })
  t.equal(limit(), 2)
})

t.test('without engine metrics, the first-token trend decides', async (t) => {
  const { limits, fill, limit } = setup()
  fill(9)
  for (let i = 0; i < 19; i++) limits.observeFirstToken('d', 20)
  limits.adjust('d', undefined)
  t.equal(limit(), 10, 'fewer than 20 samples: no verdict yet')
  limits.observeFirstToken('d', 20)
  limits.adjust('d', undefined)
  t.equal(limit(), 14, 'steady first tokens and a binding limit: up by sqrt(limit)')
  for (let i = 0; i < 10; i++) limits.observeFirstToken('d', 120)
  limits.adjust('d', undefined)
  t.equal(limit(), 8, 'first tokens far over their long-run average: down to 90 % of the load')
  for (let i = 0; i < 40; i++) limits.observeFirstToken('d', 22)
  fill(0)
  limits.adjust('d', undefined)
  t.equal(limit(), 11, 'back to normal with the limit binding: up again')
})

t.test('small first-token swings are noise, whatever their ratio', async (t) => {
  const { limits, fill, limit } = setup()
  fill(5)
  for (let i = 0; i < 40; i++) limits.observeFirstToken('d', 1)
  for (let i = 0; i < 20; i++) limits.observeFirstToken('d', 8)
  limits.adjust('d', undefined)
  t.equal(limit(), 10, '1 ms to 8 ms is under the 10 ms gap: no back-off')
})

t.test('the sampler reads /metrics of busy instances only, each interval, and acts on it', async (t) => {
  let metrics = vllmMetrics(6, 0)
  const { clock, limits, registry, fill, limit, gets, reg } = setup({}, () => ({ status: 200, text: metrics }))
  limits.start()
  fill(4)
  clock.advance(500)
  await new Promise((r) => setImmediate(r))
  t.same(gets, [], 'below half its limit an instance is not sampled')
  fill(5)
  clock.advance(500)
  await new Promise((r) => setImmediate(r))
  t.same(gets, ['http://127.0.0.1:1/metrics'])
  t.equal(limit(), 11, 'the engine queues nothing: raised')
  t.match(await reg.getSingleMetricAsString('limit'), /limit\{instance="d"\} 11/)
  metrics = vllmMetrics(9, 9)
  clock.advance(500)
  await new Promise((r) => setImmediate(r))
  t.equal(limit(), 5, 'it queues 9, over engineQueue; this router holds 9 of the 18 there: half of the 9 it runs + 2')
  registry.remove('d')
  t.notMatch(await reg.getSingleMetricAsString('limit'), /instance="d"/, 'a removed instance loses its series')
})

t.test('fixed mode never samples', async (t) => {
  const { clock, limits, fill, gets } = setup({ mode: 'fixed' }, () => ({ status: 200, text: vllmMetrics(1, 0) }))
  limits.start()
  fill(10)
  clock.advance(5000)
  await new Promise((r) => setImmediate(r))
  t.same(gets, [])
})

t.test('a raised limit admits a queued request; a lowered one holds new ones back', async (t) => {
  const { clock, registry, limits, fill } = setup()
  const reg = new Registry()
  const admission = new Admission({
    registry,
    clock,
    random: seededRandom(1),
    queueLength: 4,
    queueTimeoutMs: 10_000,
    retryAfterSeconds: 1,
    metrics: { queueDepth: new Gauge({ name: 'q', help: 'h', registers: [reg] }), queueWait: new Histogram({ name: 'w', help: 'h', registers: [reg] }) },
  })
  t.teardown(() => admission.close())
  fill(10)
  let admitted = false
  const waiting = admission.admit({ model: 'm', signal: new AbortController().signal, onMode: () => {} }).then(() => (admitted = true))
  await new Promise((r) => setImmediate(r))
  t.notOk(admitted, 'at its limit: queued')
  limits.adjust('d', { running: 10, waiting: 0 })
  await waiting
  t.ok(admitted, 'the raise woke the queue')
  limits.adjust('d', { running: 11, waiting: 20 })
  t.equal(registry.select('m', seededRandom(1))?.mode, 'full', 'lowered below what is in flight: new requests wait')
})
