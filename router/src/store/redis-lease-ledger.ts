import type { Redis } from 'ioredis'
import { Counter } from 'prom-client'
import { RTR_ERR_STORE_UNAVAILABLE } from '../errors.js'
import type { HandoffLease, LeaseEndReason, LeaseLedger, LeaseRecord, LeaseSummary } from '../leases/ledger.js'
import { MemoryLeaseLedger, type MemoryLeaseLedgerOptions } from '../leases/memory-ledger.js'
import { addTally, isUnread, tallyUnread } from '../leases/tally.js'

/** Which router replicas are alive now (the membership module); ids as in `routerId`. */
export interface RouterMembership {
  alive(): Promise<readonly string[]>
}

export interface RedisLeaseLedgerOptions extends Omit<MemoryLeaseLedgerOptions, 'onUnread'> {
  /** The caller owns it (and its timeouts: a command past `commandTimeout` counts as a failure). */
  redis: Redis
  /** Key prefix, default `handoff:`. */
  prefix?: string
  /** This replica's id: its leases go to `<prefix>leases:<routerId>`. */
  routerId: string
  routers: RouterMembership
  /** Expiry of this replica's hash, renewed by every write: a backstop for one nobody reaps. Default 10 leases. */
  keyTtlMs?: number
  /** Redis failures: mirror writes, reads that `summary` fell back from, reaps. Never thrown at the request path. */
  onError?: (err: unknown) => void
}

/**
 * The lease ledger for several router replicas on one Redis (issue 10). A request's whole
 * lifecycle runs on the replica that proxies it, so every synchronous call is answered by a
 * `MemoryLeaseLedger` in this process: Redis is never on the request path. What the others
 * need is mirrored: each unread lease of this replica is a field of the hash
 * `<prefix>leases:<routerId>` (request id → the record as JSON), set when it is issued,
 * redirected or being read and deleted when it ends. Writes are batched per tick into one
 * pipeline, one batch at a time (so in order), and never awaited by a caller.
 *
 * - `unreadBy` and `summary` add this replica's memory to the hashes of the other live
 *   routers (`routers.alive()`); an issued record past `expiresAt` does not count (P's own
 *   timer freed it). Lifetime totals (`lapsed`, `released`) and `entries` stay this
 *   replica's own.
 * - A failed write marks the mirror dirty: the next write (the next lease change, or
 *   `resync()`, which the caller runs when the connection is back) rewrites the whole hash
 *   from memory (DEL + HSET in one MULTI). A Redis that came back empty is refilled so.
 * - While the other hashes cannot be read, `summary` answers with this replica's own and
 *   `partial: true`; `unreadBy` rejects with RTR_ERR_STORE_UNAVAILABLE (a drain must not
 *   end on a partial count).
 * - `reap(routerId)` takes a dead replica's hash (read and delete in one MULTI) and returns
 *   its records still issued and unexpired: nobody else will dispatch or release them.
 */
export class RedisLeaseLedger implements LeaseLedger {
  readonly #o: RedisLeaseLedgerOptions
  readonly #mem: MemoryLeaseLedger
  readonly #redis: Redis
  readonly #prefix: string
  readonly #key: string
  readonly #keyTtlMs: number
  readonly #failures: Counter<'op'> | undefined
  /** Changes not yet sent: request id → record JSON, or null to delete. */
  readonly #pending = new Map<string, string | null>()
  /** A write failed: the next one rewrites the hash in full. */
  #dirty = false
  #scheduled = false
  /** The batch in flight; resolves (never rejects) to whether it was written. */
  #flushing: Promise<boolean> | undefined
  #closed = false

  constructor(opts: RedisLeaseLedgerOptions) {
    if (typeof opts.routerId !== 'string' || opts.routerId.length === 0) throw new RangeError('routerId must be a non-empty string')
    if (opts.keyTtlMs !== undefined && !(Number.isInteger(opts.keyTtlMs) && opts.keyTtlMs > 0)) throw new RangeError(`keyTtlMs must be a positive integer, got ${opts.keyTtlMs}`)
    this.#mem = new MemoryLeaseLedger({ ...opts, onUnread: (change, rec) => this.#changed(change, rec) })
    this.#o = opts
    this.#redis = opts.redis
    this.#prefix = opts.prefix ?? 'handoff:'
    this.#key = this.#keyOf(opts.routerId)
    this.#keyTtlMs = opts.keyTtlMs ?? opts.leaseSeconds * 10_000
    this.#failures = opts.registry
      ? new Counter({
          name: 'handoff_router_lease_store_failures_total',
          help: 'Redis commands of the lease ledger that failed (write: the mirror goes dirty until rewritten; read: a summary fell back to this router)',
          labelNames: ['op'] as const,
          registers: [opts.registry],
        })
      : undefined
  }

  /** Whether this replica's hash is known to lag its memory (a write failed since the last full rewrite). */
  get dirty(): boolean {
    return this.#dirty
  }

  issue(lease: HandoffLease): void {
    this.#mem.issue(lease)
  }

  redirect(requestId: string, decode: string): void {
    this.#mem.redirect(requestId, decode)
  }

  lapsed(requestId: string): boolean {
    return this.#mem.lapsed(requestId)
  }

  reading(requestId: string): void {
    this.#mem.reading(requestId)
  }

  done(requestId: string): void {
    this.#mem.done(requestId)
  }

  refused(requestId: string): void {
    this.#mem.refused(requestId)
  }

  release(requestId: string, reason: LeaseEndReason): 'released' | 'abandoned' | undefined {
    return this.#mem.release(requestId, reason)
  }

  onEnded(listener: (lease: LeaseRecord) => void): () => void {
    return this.#mem.onEnded(listener)
  }

  async unreadBy(prefill: string): Promise<number> {
    const own = await this.#mem.unreadBy(prefill)
    let others: LeaseRecord[]
    try {
      others = await this.#others()
    } catch (err) {
      throw new RTR_ERR_STORE_UNAVAILABLE(`the other routers' unread leases of ${prefill} cannot be read`, { cause: err })
    }
    return own + others.filter((r) => r.prefill === prefill).length
  }

  async summary(filter: { instance?: string } = {}): Promise<LeaseSummary> {
    const own = await this.#mem.summary(filter)
    let others: LeaseRecord[]
    try {
      others = await this.#others()
    } catch (err) {
      this.#failed('read', err)
      return { ...own, partial: true }
    }
    return addTally(own, tallyUnread(others, this.#o.clock.now(), filter))
  }

  /**
   * Takes the hash of `routerId` (a replica that died; never this one): reads and deletes it
   * in one MULTI, and returns its records still `issued` and not past expiry (oldest first), for the caller
   * to release to their prefillers (reason `router_gone`). Those being read are left to D's
   * heartbeats and P's lease. A second reap finds nothing. Rejects when Redis does.
   */
  async reap(routerId: string): Promise<LeaseRecord[]> {
    if (routerId === this.#o.routerId) throw new RangeError(`a router cannot reap its own leases (${routerId})`)
    const key = this.#keyOf(routerId)
    let res: [Error | null, unknown][] | null
    try {
      res = await this.#redis.multi().hvals(key).del(key).exec()
    } catch (err) {
      this.#failed('reap', err)
      throw err
    }
    const [read] = res ?? []
    if (!read || read[0]) {
      const err = read?.[0] ?? new Error('MULTI aborted')
      this.#failed('reap', err)
      throw err
    }
    const now = this.#o.clock.now()
    return parseRecords(read[1] as string[])
      .filter((r) => r.state === 'issued' && r.expiresAt > now)
      .sort((x, y) => x.issuedAt - y.issuedAt)
  }

  /**
   * Rewrites this replica's hash from memory in full (after a write that failed, or when
   * Redis comes back, perhaps empty). Resolves once written; rejects with
   * RTR_ERR_STORE_UNAVAILABLE when it could not be (it stays dirty: the next change retries).
   */
  async resync(): Promise<void> {
    this.#dirty = true
    // A batch in flight took its snapshot before this call: the rewrite comes after it.
    while (this.#flushing) await this.#flushing
    if (this.#dirty && !(await this.#flush())) throw new RTR_ERR_STORE_UNAVAILABLE(`router ${this.#o.routerId}'s unread leases could not be rewritten`)
  }

  /**
   * Sends the changes not yet written (a rewrite when dirty) and waits for them; false when
   * that failed. Callers never need it; it marks a point: what happened before is in Redis.
   */
  async flush(): Promise<boolean> {
    while (this.#flushing) await this.#flushing
    return this.#flush()
  }

  /**
   * Sends what is pending and waits for it; later changes stay in memory only. Deletes
   * nothing: a replica that comes back has a new id, and the survivors reap this one.
   */
  async close(): Promise<void> {
    if (this.#closed) return
    await this.flush()
    this.#closed = true
    this.#pending.clear()
  }

  #keyOf(routerId: string): string {
    return `${this.#prefix}leases:${routerId}`
  }

  /** The unread leases in the hashes of the other live routers. */
  async #others(): Promise<LeaseRecord[]> {
    const ids = (await this.#o.routers.alive()).filter((id) => id !== this.#o.routerId)
    if (ids.length === 0) return []
    const tx = this.#redis.pipeline()
    for (const id of ids) tx.hvals(this.#keyOf(id))
    const res = (await tx.exec()) ?? []
    const now = this.#o.clock.now()
    const out: LeaseRecord[] = []
    for (const [err, values] of res) {
      if (err) throw err
      for (const rec of parseRecords(values as string[])) if (isUnread(rec, now)) out.push(rec)
    }
    return out
  }

  #changed(change: 'set' | 'delete', rec: LeaseRecord): void {
    if (this.#closed) return
    // Dirty: the rewrite will carry it. Past maxEntries changes a rewrite is the smaller write.
    if (!this.#dirty) {
      this.#pending.set(rec.requestId, change === 'set' ? JSON.stringify(rec) : null)
      if (this.#pending.size > this.#o.maxEntries) this.#dirty = true
    }
    if (this.#dirty) this.#pending.clear()
    this.#schedule()
  }

  #schedule(): void {
    if (this.#scheduled || this.#flushing) return
    this.#scheduled = true
    queueMicrotask(() => {
      this.#scheduled = false
      void this.#flush()
    })
  }

  /** Sends one batch: the pending changes, or the whole hash when dirty. Never rejects. */
  #flush(): Promise<boolean> {
    if (this.#flushing) return this.#flushing
    if (this.#closed) return Promise.resolve(false)
    const full = this.#dirty
    if (!full && this.#pending.size === 0) return Promise.resolve(true)
    const tx = full ? this.#redis.multi().del(this.#key) : this.#redis.pipeline()
    const sets: string[] = []
    const dels: string[] = []
    if (full) {
      // The snapshot is taken now: changes from here on are pending for the next batch.
      this.#dirty = false
      for (const rec of this.#mem.unread()) sets.push(rec.requestId, JSON.stringify(rec))
    } else {
      for (const [id, json] of this.#pending) {
        if (json === null) dels.push(id)
        else sets.push(id, json)
      }
    }
    this.#pending.clear()
    if (sets.length > 0) tx.hset(this.#key, ...sets)
    if (dels.length > 0) tx.hdel(this.#key, ...dels)
    if (sets.length > 0) tx.pexpire(this.#key, this.#keyTtlMs)
    this.#flushing = tx.exec().then(
      (res) => {
        const err = res === null ? new Error('MULTI aborted') : res.find(([e]) => e)?.[0]
        if (err) throw err
        return true
      },
    ).catch((err: unknown) => {
      this.#dirty = true
      this.#pending.clear()
      this.#failed('write', err)
      return false
    }).finally(() => {
      this.#flushing = undefined
      if (this.#pending.size > 0) this.#schedule()
    })
    return this.#flushing
  }

  #failed(op: 'write' | 'read' | 'reap', err: unknown): void {
    this.#failures?.inc({ op })
    this.#o.onError?.(err)
  }
}

/** Hash values as records; a value that is not one (written by hand, a future version) is skipped. */
function parseRecords(values: readonly string[]): LeaseRecord[] {
  const out: LeaseRecord[] = []
  for (const v of values) {
    try {
      const rec = JSON.parse(v) as LeaseRecord
      if (typeof rec?.requestId === 'string' && typeof rec.prefill === 'string' && typeof rec.expiresAt === 'number') out.push(rec)
    } catch {}
  }
  return out
}
