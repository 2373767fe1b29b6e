import type { Gauge, Histogram } from 'prom-client'
import type { Clock, ClockTimer } from '../../../common/clock.js'
import type { Random } from '../../../common/random.js'
import { RTR_ERR_MODEL_NOT_FOUND, RTR_ERR_NO_INSTANCE, RTR_ERR_OVERLOADED } from '../errors.js'
import type { PrefixPreference } from '../routing/prefix-choice.js'
import type { TopologyRegistry } from '../topology/registry.js'
import type { InstanceView } from '../topology/views.js'
import type { Route } from '../topology/selection.js'

export interface AdmissionOptions {
  registry: TopologyRegistry
  clock: Clock
  random: Random
  queueLength: number
  queueTimeoutMs: number
  retryAfterSeconds: number
  metrics: { queueDepth: Gauge; queueWait: Histogram }
  /** Pair circuit breakers (topology/pair-breakers.ts): resting pairs are skipped. */
  pairs?: { readonly anyTripped: boolean; blocked(prefill: string, decode: string): boolean; chosen(prefill: string, decode: string): void }
}

/** Who is asking: the signal ends a wait when the client leaves; `mode` is told the route's mode. */
export interface AdmissionRequest {
  model: string
  signal: AbortSignal
  onMode(mode: Route['mode']): void
  /** The prompt's prefix lookup (routing/prefix-routing.ts): selection may prefer a holder. */
  prefix?: PrefixPreference
}

interface Waiter {
  req: AdmissionRequest
  since: number
  resolve(route: Route): void
  reject(err: unknown): void
  timer: ClockTimer
  onAbort(): void
}

/**
 * Admission control: a request gets a route whose instances are below their limit (a slot
 * acquired in the registry for it), or waits in one bounded FIFO queue until a slot frees up
 * or a limit grows (adaptive-limits.ts). A full queue
 * or a wait that runs out is a 429 with Retry-After: overload means slower answers and clean
 * refusals, never an instance marked down. Slots come back through the registry's `released`,
 * `up` and raised `limit` changes, which wake the head of the queue.
 */
export class Admission {
  readonly #o: AdmissionOptions
  readonly #queue: Waiter[] = []
  readonly #unsubscribe: () => void

  constructor(opts: AdmissionOptions) {
    if (opts.queueLength < 0 || opts.queueTimeoutMs <= 0) throw new RangeError('admission: queueLength >= 0, queueTimeoutMs > 0')
    this.#o = opts
    this.#unsubscribe = opts.registry.subscribe((change) => {
      if (change.type === 'released' || change.type === 'up' || (change.type === 'limit' && change.up)) this.#wake()
    })
  }

  get queued(): number {
    return this.#queue.length
  }

  /**
   * Resolves with a route whose instances are acquired; the caller releases each through the
   * registry. Rejects with RTR_ERR_MODEL_NOT_FOUND, RTR_ERR_NO_INSTANCE or RTR_ERR_OVERLOADED,
   * or with the signal's reason when the client leaves while queued.
   */
  admit(req: AdmissionRequest): Promise<Route> {
    if (this.#o.registry.unknownModel(req.model)) return Promise.reject(new RTR_ERR_MODEL_NOT_FOUND(req.model))
    const now = this.#tryAcquire(req)
    if (now instanceof Error) return Promise.reject(now)
    if (now) return Promise.resolve(now)
    if (this.#queue.length >= this.#o.queueLength) return Promise.reject(this.#overloaded(req.model, 'the admission queue is full'))
    return new Promise<Route>((resolve, reject) => {
      const waiter: Waiter = {
        req,
        since: this.#o.clock.monotonic(),
        resolve,
        reject,
        timer: this.#o.clock.setTimeout(() => {
          this.#remove(waiter)
          reject(this.#overloaded(req.model, `no slot freed within ${this.#o.queueTimeoutMs} ms`))
        }, this.#o.queueTimeoutMs),
        onAbort: () => {
          this.#remove(waiter)
          reject(req.signal.reason)
        },
      }
      req.signal.addEventListener('abort', waiter.onAbort, { once: true })
      this.#queue.push(waiter)
      this.#o.metrics.queueDepth.set(this.#queue.length)
    })
  }

  /** A decoder with a free slot for P's params after `exclude` refused them (acquired), if any. */
  retryDecoder(prefill: InstanceView, model: string, exclude: ReadonlySet<string>): InstanceView | undefined {
    const { registry, random } = this.#o
    const d = registry.selectDecoder(prefill, model, random, { exclude, ...this.#blocked() })
    if (d) {
      registry.acquire(d.id)
      this.#o.pairs?.chosen(prefill.id, d.id)
    }
    return d
  }

  /**
   * A new route of the same mode avoiding `exclude` (an instance that refused), acquired,
   * without queueing: a retry never waits and never changes how a request is served.
   */
  retryRoute<M extends Route['mode']>(model: string, exclude: ReadonlySet<string>, mode: M): (Route & { mode: M }) | undefined {
    const { registry, random } = this.#o
    const sel = registry.select(model, random, { exclude, ...this.#blocked() })
    if (!sel || sel.mode !== mode) return undefined
    this.#acquire(sel)
    return sel as Route & { mode: M }
  }

  close(): void {
    this.#unsubscribe()
    for (const w of this.#queue.splice(0)) {
      this.#o.clock.clearTimeout(w.timer)
      w.req.signal.removeEventListener('abort', w.onAbort)
      w.reject(this.#overloaded(w.req.model, 'the router is closing'))
    }
    this.#o.metrics.queueDepth.set(0)
  }

  /** A route with acquired slots; undefined when all are full; an error when none can serve. */
  #tryAcquire(req: AdmissionRequest): Route | Error | undefined {
    const { registry, random } = this.#o
    const sel = registry.select(req.model, random, req.prefix ? { ...this.#blocked(), prefix: req.prefix } : this.#blocked())
    if (!sel) return new RTR_ERR_NO_INSTANCE(req.model)
    req.onMode(sel.mode === 'full' ? sel.of : sel.mode)
    if (sel.mode === 'full') return undefined
    this.#acquire(sel)
    return sel
  }

  #blocked(): { blocked?: (prefill: string, decode: string) => boolean } {
    const pairs = this.#o.pairs
    return pairs?.anyTripped ? { blocked: (p, d) => pairs.blocked(p, d) } : {}
  }

  #acquire(route: Route): void {
    if (route.mode === 'pd') {
      this.#o.registry.acquire(route.prefill.id)
      this.#o.registry.acquire(route.decode.id)
      this.#o.pairs?.chosen(route.prefill.id, route.decode.id)
    } else {
      this.#o.registry.acquire(route.target.id)
    }
  }

  /** Admits from the head of the queue while slots allow (FIFO: no overtaking). */
  #wake(): void {
    while (this.#queue.length > 0) {
      const head = this.#queue[0] as Waiter
      const got = this.#tryAcquire(head.req)
      if (got === undefined) return
      this.#remove(head)
      this.#o.metrics.queueWait.observe((this.#o.clock.monotonic() - head.since) / 1000)
      if (got instanceof Error) head.reject(got)
      else head.resolve(got)
    }
  }

  #remove(w: Waiter): void {
    const i = this.#queue.indexOf(w)
    if (i >= 0) this.#queue.splice(i, 1)
    this.#o.clock.clearTimeout(w.timer)
    w.req.signal.removeEventListener('abort', w.onAbort)
    this.#o.metrics.queueDepth.set(this.#queue.length)
  }

  #overloaded(model: string, why: string): Error {
    const err = new RTR_ERR_OVERLOADED(model, why, this.#o.retryAfterSeconds)
    return Object.assign(err, { retryAfterSeconds: this.#o.retryAfterSeconds })
  }
}
