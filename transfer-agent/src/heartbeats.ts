import type { Clock } from '../../common/clock.js'

/**
 * What the decoder knows about the heartbeats it sent for one pull: the lease rules in
 * deadline.ts read this to decide whether P's lease was extended. Times are the injected
 * clock's monotonic milliseconds, recorded when a send was attempted (the protocol has no
 * acknowledgement, protocol reference §2.3, so "sent" is all D can know).
 */
export interface HeartbeatRecord {
  /** The P engine (`remote_engine_id`). */
  readonly engineId: string
  /** P's request id (`remote_request_id`), the id that goes into `HB:<id>,<id>`. */
  readonly requestId: string
  /** When the pull was accepted (heartbeats are due from here on). */
  readonly startedAt: number
  /** The first send, or undefined before any. */
  readonly firstSentAt: number | undefined
  /** The latest send, or undefined before any. */
  readonly lastSentAt: number | undefined
  /** The largest gap between two consecutive sends, ms; 0 with fewer than two sends. */
  readonly maxGapMs: number
  /** Sends attempted, failed ones included. */
  readonly sends: number
  /** Whether any send failed: P may have missed that extension, so the chain is broken. */
  readonly failed: boolean
}

type MutableRecord = { -readonly [K in keyof HeartbeatRecord]: HeartbeatRecord[K] }

export interface HeartbeatRegistryOptions {
  clock: Clock
}

/**
 * One HeartbeatRecord per (remote engine, remote request), from accepting a pull until the
 * pull finishes or fails. Records are grouped by engine because one `HB:` message per P
 * engine covers every request D holds for it (§2.3).
 */
export class HeartbeatRegistry {
  readonly #clock: Clock
  readonly #byEngine = new Map<string, Map<string, MutableRecord>>()
  #size = 0

  constructor(opts: HeartbeatRegistryOptions) {
    this.#clock = opts.clock
  }

  get size(): number {
    return this.#size
  }

  /** Starts tracking a pull now. A second start for the same pair is a caller bug. */
  start(engineId: string, requestId: string): HeartbeatRecord {
    let requests = this.#byEngine.get(engineId)
    if (!requests) {
      requests = new Map()
      this.#byEngine.set(engineId, requests)
    }
    if (requests.has(requestId)) throw new Error(`heartbeats for ${engineId}/${requestId} already started`)
    const record: MutableRecord = {
      engineId,
      requestId,
      startedAt: this.#clock.monotonic(),
      firstSentAt: undefined,
      lastSentAt: undefined,
      maxGapMs: 0,
      sends: 0,
      failed: false,
    }
    requests.set(requestId, record)
    this.#size++
    return record
  }

  /**
   * Records a heartbeat send for one request (call it for every id of an `HB:` message).
   * `ok: false` (the notification could not be posted) breaks the chain for good. `at` is
   * when the send started (default now): record the time from before the send, never after,
   * or a process paused between the two would claim a later extension than P granted.
   * Returns the record, or undefined for a pull that is not tracked (already ended).
   */
  sent(engineId: string, requestId: string, ok: boolean, at?: number): HeartbeatRecord | undefined {
    const record = this.#byEngine.get(engineId)?.get(requestId)
    if (!record) return undefined
    const now = at ?? this.#clock.monotonic()
    if (record.lastSentAt !== undefined) record.maxGapMs = Math.max(record.maxGapMs, now - record.lastSentAt)
    record.firstSentAt ??= now
    record.lastSentAt = now
    record.sends++
    if (!ok) record.failed = true
    return record
  }

  /** Drops the record when the pull finishes or fails; false if it was not tracked. */
  end(engineId: string, requestId: string): boolean {
    const requests = this.#byEngine.get(engineId)
    if (!requests?.delete(requestId)) return false
    if (requests.size === 0) this.#byEngine.delete(engineId)
    this.#size--
    return true
  }

  get(engineId: string, requestId: string): HeartbeatRecord | undefined {
    return this.#byEngine.get(engineId)?.get(requestId)
  }

  /** Engines with at least one tracked pull (the `HB:` messages to send). */
  engines(): string[] {
    return [...this.#byEngine.keys()]
  }

  /** P-side request ids tracked for `engineId`, in start order (one `HB:` message's ids). */
  requestIds(engineId: string): string[] {
    return [...(this.#byEngine.get(engineId)?.keys() ?? [])]
  }
}
