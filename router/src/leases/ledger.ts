/**
 * The lease ledger's contract (DESIGN "One request, end to end", steps 4–6): every handoff
 * the router hands out is reported here with its lifecycle, so the router can refuse to send
 * a decoder parameters whose blocks are about to go, release blocks nobody will read, and
 * tell a drain when a prefiller holds nothing unread. `MemoryLeaseLedger` keeps it in this
 * process; `RedisLeaseLedger` (store/redis-lease-ledger.ts, issue 10) keeps the same contract
 * for several routers on one Redis. `untrackedLedger` records nothing (tests of the request
 * path that do not care). Every call on the request path is synchronous; only the questions
 * about all routers' leases (`unreadBy`, `summary`) are async, since a shared ledger asks Redis.
 */
export interface HandoffLease {
  /** The handoff's engine request id (fresh per handoff, sent to P and D). */
  requestId: string
  /** The client's X-Request-Id, for logs. */
  clientRequestId: string
  prefill: string
  decode: string
  engineId: string
  /** P's internal request id; absent on vLLM releases before late 2025. */
  remoteRequestId?: string
  /** Wall-clock ms when P's answer arrived. */
  issuedAt: number
}

/**
 * Why the router released a lease before D read it: the client left, the decode leg failed
 * (or D refused the parameters), a bug ended the exchange, the decoder is gone (down, drained,
 * removed), the lease was too close to expiry to dispatch (`lapsed`), or the router replica
 * that proxied the request died before D was sent the parameters (`router_gone`, from a
 * surviving replica's `RedisLeaseLedger.reap`).
 */
export type LeaseEndReason = 'client_gone' | 'decode_failed' | 'router_error' | 'decoder_gone' | 'lapsed' | 'router_gone'

/**
 * `issued` → `reading` → `done`, or `released` (by the router) or `lapsed` (its time ran out
 * before it was dispatched to a decoder).
 */
export type LeaseState = 'issued' | 'reading' | 'done' | 'released' | 'lapsed'

export interface LeaseRecord extends HandoffLease {
  state: LeaseState
  /** issuedAt + the engines' lease duration (wall ms). */
  expiresAt: number
  /** When it left issued/reading (wall ms). */
  endedAt?: number
  reason?: LeaseEndReason
}

export interface LeaseSummary {
  /** Unread leases by state: issued (not past expiry) or reading. */
  inFlight: { issued: number; reading: number }
  byPrefill: Record<string, number>
  byDecode: Record<string, number>
  /** Age of the oldest unread lease, ms; null when none. */
  oldestAgeMs: number | null
  /** Lifetime totals (not filtered by instance). */
  lapsed: { beforeDispatch: number; unread: number }
  released: Partial<Record<LeaseEndReason, number>>
  /** Entries held (unread and ended ones kept for retention). */
  entries: number
  /** With an instance filter: its unread leases, oldest first (at most 100). */
  leases?: LeaseRecord[]
  /**
   * A shared ledger could not read the other routers' leases (Redis unreachable): the
   * counts are this router's own. Absent when they are complete.
   */
  partial?: true
}

export interface LeaseLedger {
  /** P answered with kv_transfer_params: the blocks are pinned for this request. */
  issue(lease: HandoffLease): void
  /** The first decoder refused the connection; the params go to `decode` instead. */
  redirect(requestId: string, decode: string): void
  /**
   * Just before the decode leg: true when the lease is past its expiry minus the margin. The
   * lease is then ended as `lapsed` (released to P) and counted; D must not get its params.
   */
  lapsed(requestId: string): boolean
  /** The decode leg is being sent: D is about to read (and its heartbeats keep the lease). */
  reading(requestId: string): void
  /** D produced its first byte: the read is done. */
  done(requestId: string): void
  /** The handoff ended without a read; P's blocks should be released. */
  release(requestId: string, reason: LeaseEndReason): void
  /** Releases every unread lease whose decoder is `decode` (it is gone); returns how many. */
  releaseDecoder(decode: string, reason: LeaseEndReason): number
  /**
   * Unread leases (issued and not past expiry, or reading) whose prefiller is `prefill`, on
   * every router. A shared ledger that cannot tell rejects (`RTR_ERR_STORE_UNAVAILABLE`)
   * rather than answer with a part: a drain must not end on a partial count.
   */
  unreadBy(prefill: string): Promise<number>
  /** The unread leases of every router; `partial` when a shared ledger could only count its own. */
  summary(filter?: { instance?: string }): Promise<LeaseSummary>
  /** Calls `listener` whenever a lease stops being unread; returns the unsubscribe function. */
  onEnded(listener: (lease: LeaseRecord) => void): () => void
}

export const untrackedLedger: LeaseLedger = Object.freeze({
  issue: () => {},
  redirect: () => {},
  lapsed: () => false,
  reading: () => {},
  done: () => {},
  release: () => {},
  releaseDecoder: () => 0,
  unreadBy: async () => 0,
  summary: async () => ({ inFlight: { issued: 0, reading: 0 }, byPrefill: {}, byDecode: {}, oldestAgeMs: null, lapsed: { beforeDispatch: 0, unread: 0 }, released: {}, entries: 0 }),
  onEnded: () => () => {},
})
