import type { Clock } from './clock.js'
import { every, type Every } from './timers.js'

/**
 * KV leases as vLLM's NixlPullConnector keeps them on a prefiller (protocol reference §2),
 * generic over what a lease holds (block ids in the simulator; an agent's registration
 * later): a lease lives until every expected consumer has sent its read-done notification,
 * someone releases it, or it expires. Heartbeats extend a lease to max(expiry, now + lease ×
 * 2/3) and never shorten it. The reaper scans every lease on each pass, not just the oldest
 * (vLLM issue #58222: stopping at the first unexpired entry strands expired leases behind a
 * renewed one).
 *
 * Deadlines are on the injected clock's monotonic time; `expiresAtWall` converts for export.
 */
export type LeaseEndReason = 'read_done' | 'released' | 'expired'

export interface Lease<T> {
  readonly id: string
  readonly value: T
  readonly consumers: number
  readonly issuedAt: number
  deadline: number
  reads: number
}

export interface LeaseTableOptions<T> {
  clock: Clock
  leaseMs: number
  /** Called once per lease when it ends (frees what it holds). */
  onEnd: (lease: Lease<T>, reason: LeaseEndReason) => void
  /** How often the reaper runs; default a tenth of the lease, at least 10 ms. */
  reapIntervalMs?: number
  /**
   * Runs each periodic reap after the I/O already waiting (the agent passes `setImmediate`).
   * A busy prefiller's timers fire before the poll phase that delivers the notifications its
   * NIXL thread already received, so a reap straight from the timer would end a lease whose
   * extension is queued behind it (issue 17 item 1, a slow P), and D, which counted on that
   * heartbeat, would read reused blocks. Default: reap at once (a ManualClock in tests).
   */
  defer?: (fn: () => void) => void
}

export class LeaseTable<T> {
  readonly #clock: Clock
  readonly #leaseMs: number
  readonly #onEnd: LeaseTableOptions<T>['onEnd']
  readonly #reapIntervalMs: number
  readonly #defer: ((fn: () => void) => void) | undefined
  readonly #leases = new Map<string, Lease<T>>()
  #reaper: Every | undefined

  constructor(opts: LeaseTableOptions<T>) {
    if (!(opts.leaseMs > 0)) throw new RangeError(`leaseMs must be positive, got ${opts.leaseMs}`)
    this.#clock = opts.clock
    this.#leaseMs = opts.leaseMs
    this.#onEnd = opts.onEnd
    this.#reapIntervalMs = opts.reapIntervalMs ?? Math.max(10, opts.leaseMs / 10)
    this.#defer = opts.defer
  }

  get size(): number {
    return this.#leases.size
  }

  get leaseMs(): number {
    return this.#leaseMs
  }

  get(id: string): Lease<T> | undefined {
    return this.#leases.get(id)
  }

  /** Leases `value` under `id` for one lease period from now. */
  pin(id: string, value: T, consumers = 1): Lease<T> {
    if (this.#leases.has(id)) throw new Error(`lease ${id} already exists`)
    const now = this.#clock.monotonic()
    const lease: Lease<T> = { id, value, consumers, issuedAt: now, deadline: now + this.#leaseMs, reads: 0 }
    this.#leases.set(id, lease)
    return lease
  }

  /** Wall-clock ms at which the lease ends if nothing extends it (what an agent exports). */
  expiresAtWall(id: string): number | undefined {
    const lease = this.#leases.get(id)
    if (!lease) return undefined
    return this.#clock.now() + (lease.deadline - this.#clock.monotonic())
  }

  /** A `<id>:<consumers>` read-done notification; unknown ids are ignored, as in vLLM. */
  readDone(id: string): boolean {
    const lease = this.#leases.get(id)
    if (!lease) return false
    lease.reads++
    if (lease.reads >= lease.consumers) this.#end(lease, 'read_done')
    return true
  }

  /** An `HB:` heartbeat: extend, never shorten. Returns false for unknown ids. */
  heartbeat(id: string): boolean {
    const lease = this.#leases.get(id)
    if (!lease) return false
    lease.deadline = Math.max(lease.deadline, this.#clock.monotonic() + (this.#leaseMs * 2) / 3)
    return true
  }

  /** A lease_release (client gone, D failed): end it now. */
  release(id: string): boolean {
    const lease = this.#leases.get(id)
    if (!lease) return false
    this.#end(lease, 'released')
    return true
  }

  /** Ends every lease past its deadline; returns how many. Scans the whole table. */
  reap(): number {
    const now = this.#clock.monotonic()
    let n = 0
    for (const lease of [...this.#leases.values()]) {
      if (lease.deadline <= now) {
        this.#end(lease, 'expired')
        n++
      }
    }
    return n
  }

  /** Runs the reaper periodically on the injected clock until `stop()`. */
  start(): void {
    if (this.#reaper) return
    const defer = this.#defer
    this.#reaper = every(this.#clock, this.#reapIntervalMs, () => {
      if (!defer) {
        this.reap()
        return
      }
      return new Promise<void>((resolve) =>
        defer(() => {
          this.reap()
          resolve()
        }),
      )
    })
  }

  stop(): void {
    this.#reaper?.stop()
    this.#reaper = undefined
  }

  #end(lease: Lease<T>, reason: LeaseEndReason): void {
    this.#leases.delete(lease.id)
    this.#onEnd(lease, reason)
  }
}
