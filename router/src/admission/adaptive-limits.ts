import type { FastifyBaseLogger } from 'fastify'
import type { Counter, Gauge } from 'prom-client'
import type { Clock, ClockTimer } from '../../../common/clock.js'
import type { HttpGet } from '../topology/prober.js'
import type { TopologyRegistry } from '../topology/registry.js'
import { parseEngineLoad, type EngineLoad } from './engine-load.js'

/** admission.limit in the router config (schemas/router-config.ts). */
export interface LimitPolicy {
  mode: 'adaptive' | 'fixed'
  min: number
  max: number
  sampleIntervalMs: number
  /** Requests an engine may hold waiting (its own queue) before the limit comes down. */
  engineQueue: number
  /** Recent first-token time over its long-run average that counts as congestion. */
  firstTokenTolerance: number
}

export interface AdaptiveLimitsOptions {
  registry: TopologyRegistry
  /** GET with a timeout, on the probes' own connections (prober.ts). */
  get: HttpGet
  clock: Clock
  log: FastifyBaseLogger
  policy: LimitPolicy
  timeoutMs: number
  /** Requests waiting in the router's admission queue now (a raise takes at least them). */
  queued?: () => number
  metrics: { limit: Gauge<'instance'>; changes: Counter<'direction'>; samples: Counter<'outcome'> }
}

/** An instance is sampled once it holds this share of its limit: below it the limit binds nothing. */
const BUSY = 0.5
/** It is raised when it holds this share of its limit and its engine queues nothing. */
const RAISE_AT = 0.9
/** By this share of the limit at a time, when the engine reports its queue (empty). */
const RAISE_BY = 0.1
/** Without engine metrics: this many first-token samples before their trend is trusted. */
const WARM_SAMPLES = 20
/** First-token times closer than this are one loopback's noise, not a trend. */
const MIN_GAP_MS = 10
/** Without engine metrics, a congested instance's limit comes down to this share of its load. */
const BACKOFF = 0.9

interface Trend {
  /** Exponentially weighted first-token times: recent (alpha 0.2) and long-run (alpha 0.02). */
  short: number
  long: number
  samples: number
}

/**
 * Admission that follows the engine, not a constant (issue 23 item 1). Every instance starts at
 * `limits.maxInflightPerInstance`; each sample interval, the instances holding half their limit
 * or more are asked for their own load (vLLM's `vllm:num_requests_running` and
 * `vllm:num_requests_waiting` on /metrics), and their limit moves:
 *
 * - the engine queues more than `engineQueue` requests: down to what it runs plus
 *   `engineQueue`, times this router's share of its requests (in flight here over the
 *   engine's running + waiting), so routers sharing an engine split it in proportion;
 * - the engine queues nothing and the instance is at 90 % of its limit or more: up by 10 %,
 *   or by as many as wait in the router's queue when they are more, up to what the engine ran
 *   when it last queued (a burst reaches an engine with room at once; one known to be full is
 *   probed 10 % at a time).
 *
 * An engine without those metrics is judged by the trend of its first-token times (P's whole
 * answer, D's first streamed frame) as in gradient concurrency limits: recent ones over
 * `firstTokenTolerance` times the long-run average bring the limit down to 90 % of the load;
 * a loaded instance otherwise gains sqrt(limit). Always within [min, max].
 *
 * Requests over a lowered limit finish; new ones wait in the admission queue, which ends in
 * 429 + Retry-After when full. A raise wakes that queue (the registry's `limit` change). No
 * verdict here touches health: a queueing engine is busy, not down.
 */
export class AdaptiveLimits {
  readonly #o: AdaptiveLimitsOptions
  readonly #trends = new Map<string, Trend>()
  /** What each engine ran when it last queued past engineQueue: its capacity, as far as seen. */
  readonly #ceilings = new Map<string, number>()
  readonly #sampling = new Set<string>()
  readonly #unsubscribe: () => void
  #timer: ClockTimer | undefined

  constructor(opts: AdaptiveLimitsOptions) {
    const p = opts.policy
    if (!(p.min >= 1 && p.max >= p.min && p.sampleIntervalMs > 0 && p.engineQueue >= 0 && p.firstTokenTolerance > 1)) {
      throw new RangeError('admission.limit: 1 <= min <= max, sampleIntervalMs > 0, engineQueue >= 0, firstTokenTolerance > 1')
    }
    this.#o = opts
    const show = (id: string): void => {
      const l = opts.registry.load(id)
      if (l) opts.metrics.limit.set({ instance: id }, l.limit)
    }
    for (const id of opts.registry.ids()) show(id)
    this.#unsubscribe = opts.registry.subscribe((change) => {
      if (change.type === 'added') show(change.instanceId)
      else if (change.type === 'limit') opts.metrics.limit.set({ instance: change.instanceId }, change.limit)
      else if (change.type === 'removed') {
        this.#trends.delete(change.instanceId)
        this.#ceilings.delete(change.instanceId)
        opts.metrics.limit.remove({ instance: change.instanceId })
      }
    })
  }

  /** Samples the busy instances every interval until stop(). Fixed mode never samples. */
  start(): void {
    if (this.#o.policy.mode === 'fixed' || this.#timer) return
    const tick = (): void => {
      this.#timer = this.#o.clock.setTimeout(tick, this.#o.policy.sampleIntervalMs)
      this.#timer.unref?.()
      for (const id of this.#o.registry.busy(BUSY)) void this.sample(id)
    }
    this.#timer = this.#o.clock.setTimeout(tick, this.#o.policy.sampleIntervalMs)
    this.#timer.unref?.()
  }

  stop(): void {
    if (this.#timer) this.#o.clock.clearTimeout(this.#timer)
    this.#timer = undefined
  }

  close(): void {
    this.stop()
    this.#unsubscribe()
  }

  /** How long an engine took to its first token (the prefill leg's answer, a stream's first frame). */
  observeFirstToken(id: string, ms: number): void {
    const t = this.#trends.get(id)
    if (!t) {
      this.#trends.set(id, { short: ms, long: ms, samples: 1 })
      return
    }
    t.short += 0.2 * (ms - t.short)
    t.long += 0.02 * (ms - t.long)
    t.samples++
  }

  /** Reads the engine's load (at most one read per instance at a time) and adjusts its limit. */
  async sample(id: string): Promise<void> {
    if (this.#sampling.has(id)) return
    this.#sampling.add(id)
    const { registry, get, timeoutMs, metrics, log } = this.#o
    let load: EngineLoad | undefined
    try {
      const res = await get(`${registry.url(id)}/metrics`, timeoutMs)
      load = res.status === 200 ? parseEngineLoad(res.text) : undefined
      metrics.samples.inc({ outcome: load ? 'ok' : 'no_metrics' })
    } catch (err) {
      metrics.samples.inc({ outcome: 'failed' })
      log.debug({ instance: id, err }, 'engine load: /metrics unreadable')
    } finally {
      this.#sampling.delete(id)
    }
    if (registry.has(id)) this.adjust(id, load)
  }

  /** One step of the policy for `id` given its engine's load (undefined: not known). */
  adjust(id: string, load: EngineLoad | undefined): void {
    const { registry, policy, metrics, log } = this.#o
    const now = registry.load(id)
    if (!now) return
    const { inflight, limit } = now
    let next = limit
    if (load) {
      if (load.waiting > policy.engineQueue) {
        // What the engine can run plus the queue it may keep, in this router's share. Not
        // "in flight less the excess": the engine still queues requests admitted before the
        // last cut, and subtracting them again each sample would drive the limit to min.
        const total = load.running + load.waiting
        const share = total > 0 ? Math.min(1, inflight / total) : 1
        next = Math.min(limit, Math.floor(share * (load.running + policy.engineQueue)))
        this.#ceilings.set(id, load.running)
      } else if (load.waiting === 0 && inflight >= limit * RAISE_AT) {
        // A burst waiting in the router goes in one step to an engine never seen full, or up
        // to where it was last full; past that only 10 % at a time (its capacity may have grown).
        const ceiling = this.#ceilings.get(id)
        const waiting = this.#o.queued?.() ?? 0
        const burst = ceiling === undefined ? waiting : Math.min(waiting, ceiling + policy.engineQueue - limit)
        next = limit + Math.max(1, Math.ceil(limit * RAISE_BY), burst)
      }
    } else {
      const t = this.#trends.get(id)
      if (t && t.samples >= WARM_SAMPLES && t.short > policy.firstTokenTolerance * t.long && t.short - t.long > MIN_GAP_MS) {
        next = Math.floor(Math.min(limit, inflight) * BACKOFF)
      } else if (t && t.samples >= WARM_SAMPLES && inflight >= limit * RAISE_AT) {
        next = limit + Math.max(1, Math.ceil(Math.sqrt(limit)))
      }
    }
    next = Math.min(policy.max, Math.max(policy.min, next))
    if (next === limit) return
    registry.setLimit(id, next)
    metrics.changes.inc({ direction: next > limit ? 'up' : 'down' })
    log.debug({ instance: id, from: limit, to: next, inflight, ...(load ?? {}) }, 'instance limit changed')
  }
}
