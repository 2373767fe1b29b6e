import type { Registry, RegistryContentType } from 'prom-client'
import type { Clock } from '../../../common/clock.js'
import type { HandoffLease, LeaseEndReason, LeaseLedger, LeaseRecord, LeaseSummary } from './ledger.js'
import { createLeaseMetrics, type LeaseMetrics } from './metrics.js'
import { tallyUnread } from './tally.js'

export interface MemoryLeaseLedgerOptions {
  clock: Clock
  /** The engines' lease duration (vLLM's kv_lease_duration, the agents' leaseSeconds). */
  leaseSeconds: number
  /** A lease within this many ms of its expiry is not dispatched to D. */
  marginMs: number
  /** Ended entries are kept this long (for GET /leases), then pruned. */
  retentionMs: number
  /** Cap on entries held; at the cap ended entries go first, then the oldest unread. */
  maxEntries: number
  /** The router's metrics registry; none: no metrics. */
  registry?: Registry<RegistryContentType>
  /** Leases the router released (not ones that lapsed unread): P's agent should free them now. */
  onRelease?: (leases: readonly LeaseRecord[], reason: LeaseEndReason) => void
  /**
   * Each change to the unread leases, in order: `set` when one is issued, redirected or
   * being read, `delete` when it ends or is evicted. For a mirror (RedisLeaseLedger); the
   * record is live, so copy what must outlast the call.
   */
  onUnread?: (change: 'set' | 'delete', lease: LeaseRecord) => void
}

/**
 * The lease ledger in this process's memory. Leases not yet dispatched to a decoder are kept
 * in issue order, which is also expiry order (one lease duration for all), so expired ones
 * are swept from the front; abandoned ones (below) in abandon order, which is their expiry
 * order too; ended ones in end order, pruned from the front after `retentionMs`. A lease
 * being read does not lapse here while its exchange runs: D's heartbeats extend it on P
 * (protocol reference §1, item 3) until D's first byte. When the exchange ends without that
 * byte, the lease is abandoned, never released (ledger.ts, "who may end a lease early"): it
 * stays unread until P's lease surely ended. The sweeps run lazily on each call, so nothing
 * needs a timer and a ManualClock drives it all in tests. Every operation is O(1) amortised,
 * except `summary`.
 */
export class MemoryLeaseLedger implements LeaseLedger {
  readonly #o: MemoryLeaseLedgerOptions
  readonly #leaseMs: number
  /** Unread leases (issued, reading), in issue order. */
  readonly #live = new Map<string, LeaseRecord>()
  /** The issued ones among them (not yet dispatched to D), in issue order. */
  readonly #issued = new Map<string, LeaseRecord>()
  /** The abandoned ones among them (dispatched, the exchange over without D's first byte), in abandon order. */
  readonly #abandoned = new Map<string, LeaseRecord>()
  /** Ended leases, in end order. */
  readonly #ended = new Map<string, LeaseRecord>()
  readonly #byPrefill = new Map<string, Set<string>>()
  readonly #listeners = new Set<(lease: LeaseRecord) => void>()
  readonly #metrics: LeaseMetrics | undefined
  readonly #totals = { lapsedBeforeDispatch: 0, lapsedUnread: 0, lapsedAfterDispatch: 0, released: {} as Partial<Record<LeaseEndReason, number>>, abandoned: {} as Partial<Record<LeaseEndReason, number>> }

  constructor(opts: MemoryLeaseLedgerOptions) {
    if (!(opts.leaseSeconds > 0)) throw new RangeError(`leaseSeconds must be > 0, got ${opts.leaseSeconds}`)
    if (!(opts.marginMs >= 0 && opts.marginMs < opts.leaseSeconds * 1000)) throw new RangeError(`marginMs must be >= 0 and below the lease (${opts.leaseSeconds * 1000} ms), got ${opts.marginMs}`)
    if (!(opts.retentionMs >= 0)) throw new RangeError(`retentionMs must be >= 0, got ${opts.retentionMs}`)
    if (!(Number.isInteger(opts.maxEntries) && opts.maxEntries >= 1)) throw new RangeError(`maxEntries must be a positive integer, got ${opts.maxEntries}`)
    this.#o = opts
    this.#leaseMs = opts.leaseSeconds * 1000
    this.#metrics = opts.registry ? createLeaseMetrics(opts.registry, () => this.#inFlight()) : undefined
  }

  get size(): number {
    return this.#live.size + this.#ended.size
  }

  issue(lease: HandoffLease): void {
    this.#sweep()
    const existing = this.#live.get(lease.requestId) ?? this.#ended.get(lease.requestId)
    if (existing) this.#forget(existing)
    while (this.size >= this.#o.maxEntries) this.#evictOne()
    const rec: LeaseRecord = { ...lease, state: 'issued', expiresAt: lease.issuedAt + this.#leaseMs }
    this.#live.set(rec.requestId, rec)
    this.#issued.set(rec.requestId, rec)
    index(this.#byPrefill, rec.prefill, rec.requestId)
    this.#metrics?.issued.inc()
    this.#o.onUnread?.('set', rec)
  }

  redirect(requestId: string, decode: string): void {
    const rec = this.#live.get(requestId)
    if (!rec || rec.decode === decode) return
    rec.decode = decode
    this.#o.onUnread?.('set', rec)
  }

  lapsed(requestId: string): boolean {
    const rec = this.#live.get(requestId)
    if (!rec) return false
    if (this.#o.clock.now() < rec.expiresAt - this.#o.marginMs) return false
    this.#totals.lapsedBeforeDispatch++
    this.#metrics?.lapsed.inc({ when: 'before_dispatch' })
    // P would free the blocks within the margin anyway; telling it now frees them at once.
    this.#end(rec, 'released', 'lapsed')
    this.#o.onRelease?.([rec], 'lapsed')
    return true
  }

  reading(requestId: string): void {
    const rec = this.#live.get(requestId)
    if (!rec || rec.abandonedAt !== undefined) return
    rec.state = 'reading'
    this.#issued.delete(requestId)
    this.#o.onUnread?.('set', rec)
  }

  refused(requestId: string): void {
    const rec = this.#live.get(requestId)
    if (!rec || rec.state !== 'reading' || rec.abandonedAt !== undefined) return
    rec.state = 'issued'
    // Out of issue order by the time of the call, so the sweep may reach it a little late;
    // `lapsed` reads the record itself, and the caller re-dispatches or releases it at once.
    this.#issued.set(requestId, rec)
    this.#o.onUnread?.('set', rec)
  }

  done(requestId: string): void {
    const rec = this.#live.get(requestId)
    if (rec) this.#end(rec, 'done')
  }

  release(requestId: string, reason: LeaseEndReason): 'released' | 'abandoned' | undefined {
    const rec = this.#live.get(requestId)
    if (!rec) return undefined
    if (rec.state === 'issued') {
      this.#end(rec, 'released', reason)
      this.#o.onRelease?.([rec], reason)
      return 'released'
    }
    // Dispatched: D may be reading. P's lease (and D's heartbeats) decide; after the last
    // heartbeat P holds it at most one lease longer, so it counts as unread until then.
    if (rec.abandonedAt === undefined) {
      const now = this.#o.clock.now()
      rec.abandonedAt = now
      rec.reason = reason
      rec.expiresAt = Math.max(rec.expiresAt, now + this.#leaseMs)
      this.#abandoned.set(requestId, rec)
      this.#totals.abandoned[reason] = (this.#totals.abandoned[reason] ?? 0) + 1
      this.#metrics?.abandoned.inc({ reason })
      this.#o.onUnread?.('set', rec)
    }
    return 'abandoned'
  }

  async unreadBy(prefill: string): Promise<number> {
    this.#sweep()
    return this.#byPrefill.get(prefill)?.size ?? 0
  }

  async summary(filter: { instance?: string } = {}): Promise<LeaseSummary> {
    this.#sweep()
    const { leases, ...unread } = tallyUnread(this.#live.values(), this.#o.clock.now(), filter)
    return {
      ...unread,
      lapsed: { beforeDispatch: this.#totals.lapsedBeforeDispatch, unread: this.#totals.lapsedUnread, afterDispatch: this.#totals.lapsedAfterDispatch },
      released: { ...this.#totals.released },
      abandoned: { ...this.#totals.abandoned },
      entries: this.size,
      leaseSeconds: this.#o.leaseSeconds,
      ...(filter.instance !== undefined ? { leases } : {}),
    }
  }

  /** Copies of the unread leases (issued and not past expiry, or reading), in issue order. */
  unread(): LeaseRecord[] {
    this.#sweep()
    return [...this.#live.values()].map((rec) => ({ ...rec }))
  }

  onEnded(listener: (lease: LeaseRecord) => void): () => void {
    this.#listeners.add(listener)
    return () => this.#listeners.delete(listener)
  }

  #inFlight(): { issued: number; reading: number } {
    this.#sweep()
    return { issued: this.#issued.size, reading: this.#live.size - this.#issued.size }
  }

  #end(rec: LeaseRecord, state: 'done' | 'released' | 'lapsed', reason?: LeaseEndReason): void {
    this.#live.delete(rec.requestId)
    this.#issued.delete(rec.requestId)
    this.#abandoned.delete(rec.requestId)
    unindex(this.#byPrefill, rec.prefill, rec.requestId)
    rec.state = state
    rec.endedAt = this.#o.clock.now()
    if (reason) {
      rec.reason = reason
      if (state === 'released') {
        this.#totals.released[reason] = (this.#totals.released[reason] ?? 0) + 1
        this.#metrics?.released.inc({ reason })
      }
    }
    // Kept only to be counted for retentionMs (none by default).
    if (this.#o.retentionMs > 0) this.#ended.set(rec.requestId, rec)
    this.#o.onUnread?.('delete', rec)
    for (const l of this.#listeners) l(rec)
  }

  /**
   * Issued leases past expiry lapse (P's own timer freed the blocks), and so do abandoned
   * ones past theirs (keeping the reason they were abandoned for); old ended ones go.
   */
  #sweep(): void {
    const now = this.#o.clock.now()
    for (const rec of this.#issued.values()) {
      if (rec.expiresAt > now) break
      this.#totals.lapsedUnread++
      this.#metrics?.lapsed.inc({ when: 'unread' })
      this.#end(rec, 'lapsed')
    }
    for (const rec of this.#abandoned.values()) {
      if (rec.expiresAt > now) break
      this.#totals.lapsedAfterDispatch++
      this.#metrics?.lapsed.inc({ when: 'after_dispatch' })
      this.#end(rec, 'lapsed', rec.reason)
    }
    for (const rec of this.#ended.values()) {
      if ((rec.endedAt ?? 0) + this.#o.retentionMs > now) break
      this.#ended.delete(rec.requestId)
    }
  }

  /** At the cap: the oldest ended entry goes; with none, the oldest unread one (counted). */
  #evictOne(): void {
    const ended = this.#ended.values().next()
    if (!ended.done) {
      this.#ended.delete(ended.value.requestId)
      this.#metrics?.evicted.inc({ kind: 'ended' })
      return
    }
    const live = this.#live.values().next()
    if (live.done) return
    this.#forget(live.value)
    this.#metrics?.evicted.inc({ kind: 'unread' })
  }

  #forget(rec: LeaseRecord): void {
    if (this.#live.has(rec.requestId)) this.#o.onUnread?.('delete', rec)
    this.#live.delete(rec.requestId)
    this.#issued.delete(rec.requestId)
    this.#abandoned.delete(rec.requestId)
    this.#ended.delete(rec.requestId)
    unindex(this.#byPrefill, rec.prefill, rec.requestId)
  }
}

function index(map: Map<string, Set<string>>, key: string, id: string): void {
  let set = map.get(key)
  if (!set) map.set(key, (set = new Set()))
  set.add(id)
}

function unindex(map: Map<string, Set<string>>, key: string, id: string): void {
  const set = map.get(key)
  if (!set) return
  set.delete(id)
  if (set.size === 0) map.delete(key)
}
