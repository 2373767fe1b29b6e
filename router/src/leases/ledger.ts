/**
 * The lease ledger's contract (DESIGN "One request, end to end", steps 4–6): every handoff
 * the router hands out is reported here with its lifecycle, so the router can refuse to send
 * a decoder parameters whose blocks are about to go, release blocks nobody will read, and
 * tell a drain when a prefiller holds nothing unread. `MemoryLeaseLedger` keeps it in this
 * process; `RedisLeaseLedger` (store/redis-lease-ledger.ts, issue 10) keeps the same contract
 * for several routers on one Redis. `untrackedLedger` records nothing (tests of the request
 * path that do not care). Every call on the request path is synchronous; only the questions
 * about all routers' leases (`unreadBy`, `summary`) are async, since a shared ledger asks Redis.
 *
 * Who may end a lease early (DESIGN "Who may end a lease early", issue 17). A lease the
 * router handed to D ends early only on D's own word, never on the router's inference (D
 * marked down, removed, drained, its HTTP leg failed, timed out or was aborted because the
 * client left): D may still be reading, P would reuse the blocks under the READ (the
 * simulator, like vLLM, reuses freed blocks at once), and D's own lease check only models
 * expiry, so it would decode another request's KV. Hence:
 * - `release` ends a lease only while it is `issued` (never dispatched, or D refused the
 *   connection: `refused`), and tells P's agent to free the blocks now;
 * - on a lease being read it *abandons* it instead: the router stops following it and counts
 *   it unread until P's lease surely ended (one lease past the abandonment, since D's last
 *   heartbeat extends P's lease by less than that), then it lapses;
 * - nothing else ends a dispatched lease early; the ledger has no "release this decoder's
 *   leases" call at all.
 * When the window starts (DESIGN "When the router's own window starts", issue 37): at the
 * prefill leg's send (`issuedAt`). Counted from P's answer instead, a router pause, a slow hop
 * or an API server that sends the answer late behind its engine core would all be added on
 * top of P's real expiry, and only the margin would cover them (measured: 11 of 228 answers
 * another request's text after a 3.5 s router pause). The margin still covers what comes
 * after the check: clock rate error, and D's own queue before its first READ.
 * `issue` and `reading` run in one synchronous turn on the request path, so a mirror of the
 * ledger (the Redis one) never shows `issued` for a lease D was sent: a surviving replica may
 * release a dead one's `issued` leases (reap) without that race.
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
  /**
   * Wall-clock ms when the router sent the prefill leg that P answered (the try that
   * succeeded), not when P's answer arrived: P starts its lease when it finishes the request,
   * so never before this, and whatever held the answer up on its way back is inside the lease.
   */
  issuedAt: number
}

/**
 * Why the router released (or abandoned) a lease before D read it: the client left, the
 * decode leg failed, a bug ended the exchange, the lease was too close to expiry to dispatch
 * (`lapsed`), or the router replica that proxied the request died before D was sent the
 * parameters (`router_gone`, from a surviving replica's `RedisLeaseLedger.reap`).
 */
export type LeaseEndReason = 'client_gone' | 'decode_failed' | 'router_error' | 'lapsed' | 'router_gone'

/**
 * `issued` → `reading` → `done`, or `released` (by the router, only while issued) or `lapsed`
 * (its time ran out: before it was dispatched, or after it was abandoned).
 */
export type LeaseState = 'issued' | 'reading' | 'done' | 'released' | 'lapsed'

export interface LeaseRecord extends HandoffLease {
  state: LeaseState
  /** issuedAt + the engines' lease duration (wall ms). */
  expiresAt: number
  /** When it left issued/reading (wall ms). */
  endedAt?: number
  /**
   * Being read, when its exchange ended without D's first byte (wall ms): the router no
   * longer follows it; `expiresAt` was moved to when P's lease surely ended.
   */
  abandonedAt?: number
  reason?: LeaseEndReason
}

export interface LeaseSummary {
  /** Unread leases by state: issued (not past expiry) or reading. */
  inFlight: { issued: number; reading: number }
  byPrefill: Record<string, number>
  byDecode: Record<string, number>
  /** Age of the oldest unread lease, ms; null when none. */
  oldestAgeMs: number | null
  /**
   * Lifetime totals (not filtered by instance): lapsed before dispatch (caught before the
   * decode leg), unread (issued, never dispatched) and after dispatch (abandoned, then P's
   * lease surely over); released by the router, and abandoned, by reason.
   */
  lapsed: { beforeDispatch: number; unread: number; afterDispatch: number }
  released: Partial<Record<LeaseEndReason, number>>
  abandoned: Partial<Record<LeaseEndReason, number>>
  /** Entries held (unread and ended ones kept for retention). */
  entries: number
  /** The engines' lease this ledger judges by (leases.leaseSeconds): check it equals theirs. */
  leaseSeconds: number
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
  /** D refused the connection: it never got the params, so the lease is `issued` again. */
  refused(requestId: string): void
  /** D produced its first byte: the read is done. */
  done(requestId: string): void
  /**
   * The handoff ended without a read. An `issued` lease is released (P's agent is told to
   * free the blocks); one being read is abandoned, left to P (see the header). Says which,
   * or undefined for a lease not unread here.
   */
  release(requestId: string, reason: LeaseEndReason): 'released' | 'abandoned' | undefined
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
  refused: () => {},
  done: () => {},
  release: () => undefined,
  unreadBy: async () => 0,
  summary: async () => ({
    inFlight: { issued: 0, reading: 0 },
    byPrefill: {},
    byDecode: {},
    oldestAgeMs: null,
    lapsed: { beforeDispatch: 0, unread: 0, afterDispatch: 0 },
    released: {},
    abandoned: {},
    entries: 0,
    leaseSeconds: 0,
  }),
  onEnded: () => () => {},
})
