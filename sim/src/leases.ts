import type { Clock, ClockTimer } from '../../common/clock.js'

/**
 * Prefill-side KV leases, as vLLM's NixlPullConnector keeps them (protocol reference §2):
 * a finished prefill's blocks stay pinned until every expected consumer has sent its
 * read-done notification, the router releases them, or the lease expires. Heartbeats extend
 * a lease to max(expiry, now + lease × 2/3) and never shorten it. The reaper scans every
 * lease on each pass, not just the oldest ones (vLLM issue #58222: stopping at the first
 * unexpired entry strands expired leases behind a renewed one).
 *
 * Deadlines are on the injected clock's monotonic time; `expiresAtWall` converts for export.
 */
export type LeaseEndReason = 'read_done' | 'released' | 'expired'

export interface Lease {
  readonly requestId: string
  readonly blockIds: readonly number[]
  readonly consumers: number
  readonly issuedAt: number
  deadline: number
  reads: number
}

export interface LeaseTableOptions {
  clock: Clock
  leaseMs: number
  /** Called once per lease when it ends; frees the blocks. */
  onEnd: (lease: Lease, reason: LeaseEndReason) => void
  /** How often the reaper runs; default a tenth of the lease, at least 10 ms. */
  reapIntervalMs?: number
}

export class LeaseTable {
  readonly #clock: Clock
  readonly #leaseMs: number
  readonly #onEnd: LeaseTableOptions['onEnd']
  readonly #reapIntervalMs: number
  readonly #leases = new Map<string, Lease>()
  #timer: ClockTimer | undefined

  constructor(opts: LeaseTableOptions) {
    if (!(opts.leaseMs > 0)) throw new RangeError(`leaseMs must be positive, got ${opts.leaseMs}`)
    this.#clock = opts.clock
    this.#leaseMs = opts.leaseMs
    this.#onEnd = opts.onEnd
    this.#reapIntervalMs = opts.reapIntervalMs ?? Math.max(10, opts.leaseMs / 10)
  }

  get size(): number {
    return this.#leases.size
  }

  get(requestId: string): Lease | undefined {
    return this.#leases.get(requestId)
  }

  /** Pins blocks for `requestId` for one lease period from now. */
  pin(requestId: string, blockIds: readonly number[], consumers = 1): Lease {
    if (this.#leases.has(requestId)) throw new Error(`lease ${requestId} already exists`)
    const now = this.#clock.monotonic()
    const lease: Lease = { requestId, blockIds: [...blockIds], consumers, issuedAt: now, deadline: now + this.#leaseMs, reads: 0 }
    this.#leases.set(requestId, lease)
    return lease
  }

  /** Wall-clock ms at which the lease ends if nothing extends it (what an agent exports). */
  expiresAtWall(requestId: string): number | undefined {
    const lease = this.#leases.get(requestId)
    if (!lease) return undefined
    return this.#clock.now() + (lease.deadline - this.#clock.monotonic())
  }

  /** A `<id>:<consumers>` read-done notification; unknown ids are ignored, as in vLLM. */
  readDone(requestId: string): boolean {
    const lease = this.#leases.get(requestId)
    if (!lease) return false
    lease.reads++
    if (lease.reads >= lease.consumers) this.#end(lease, 'read_done')
    return true
  }

  /** An `HB:` heartbeat: extend, never shorten. Returns false for unknown ids. */
  heartbeat(requestId: string): boolean {
    const lease = this.#leases.get(requestId)
    if (!lease) return false
    lease.deadline = Math.max(lease.deadline, this.#clock.monotonic() + (this.#leaseMs * 2) / 3)
    return true
  }

  /** The router's lease_release (client gone, D failed): free now. */
  release(requestId: string): boolean {
    const lease = this.#leases.get(requestId)
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
    if (this.#timer) return
    const tick = (): void => {
      this.reap()
      this.#timer = this.#clock.setTimeout(tick, this.#reapIntervalMs)
      this.#timer.unref?.()
    }
    this.#timer = this.#clock.setTimeout(tick, this.#reapIntervalMs)
    this.#timer.unref?.()
  }

  stop(): void {
    if (this.#timer) this.#clock.clearTimeout(this.#timer)
    this.#timer = undefined
  }

  #end(lease: Lease, reason: LeaseEndReason): void {
    this.#leases.delete(lease.requestId)
    this.#onEnd(lease, reason)
  }
}
