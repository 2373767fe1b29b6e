import type { Clock } from '../../common/clock.js'
import { LeaseTable, type Lease, type LeaseEndReason } from '../../common/lease-table.js'
import { xfaError } from './errors.js'

/**
 * The prefiller's side of KV leases (DESIGN "Transfer agent" → Heartbeats; protocol reference
 * §2.3): blocks of one request stay held until every read-done notification came, the lease
 * is released, or it expires; `HB:` notifications extend it. The table itself is
 * common/lease-table.ts; this adds what the agent's API promises on top: block ids in range,
 * no block under two leases, and an export of the deadline on this agent's clock.
 */
export interface PrefillLeasesOptions {
  clock: Clock
  leaseMs: number
  numBlocks: number
  /** Called once per ended lease: the engine may reuse `blockIds` now. */
  onEnd: (requestId: string, blockIds: readonly number[], reason: LeaseEndReason, lease: Lease<readonly number[]>) => void
  /** The reaper runs after pending I/O (LeaseTableOptions.defer); the agent passes setImmediate. */
  deferReap?: (fn: () => void) => void
}

export interface HeartbeatOutcome {
  extended: number
  unknown: number
}

export class PrefillLeases {
  readonly #table: LeaseTable<readonly number[]>
  readonly #clock: Clock
  readonly #numBlocks: number
  /** Block id → the request leasing it. */
  readonly #owner = new Map<number, string>()

  constructor(opts: PrefillLeasesOptions) {
    this.#clock = opts.clock
    this.#numBlocks = opts.numBlocks
    this.#table = new LeaseTable<readonly number[]>({
      clock: opts.clock,
      leaseMs: opts.leaseMs,
      ...(opts.deferReap ? { defer: opts.deferReap } : {}),
      onEnd: (lease, reason) => {
        for (const b of lease.value) this.#owner.delete(b)
        opts.onEnd(lease.id, lease.value, reason, lease)
      },
    })
  }

  get size(): number {
    return this.#table.size
  }

  get leaseMs(): number {
    return this.#table.leaseMs
  }

  /**
   * Leases `blockIds` for `requestId`; returns the deadline in seconds on this agent's
   * monotonic clock (what the engine exports as `remote_blocks_expiry_time`: producer clock,
   * never wall time, protocol reference §2.6).
   */
  lease(requestId: string, blockIds: readonly number[], consumers = 1): number {
    if (this.#table.get(requestId)) throw xfaError('XFA_ERR_LEASE_EXISTS', `request ${requestId} already holds a lease`)
    const seen = new Set<number>()
    for (const b of blockIds) {
      if (!Number.isInteger(b) || b < 0 || b >= this.#numBlocks) {
        throw xfaError('XFA_ERR_INVALID_ARG', `block ${b} outside the region (0..${this.#numBlocks - 1})`)
      }
      if (seen.has(b)) throw xfaError('XFA_ERR_INVALID_ARG', `block ${b} listed twice`)
      seen.add(b)
      const owner = this.#owner.get(b)
      if (owner !== undefined) throw xfaError('XFA_ERR_BLOCKS_LEASED', `block ${b} is leased by ${owner}`)
    }
    const lease = this.#table.pin(requestId, [...blockIds], consumers)
    for (const b of blockIds) this.#owner.set(b, requestId)
    return lease.deadline / 1000
  }

  /** `<request id>:<n>` from a decoder's READ: one consumer done. */
  readDone(requestId: string): boolean {
    return this.#table.readDone(requestId)
  }

  /** `HB:<id>,<id>`: extends every known id, counts the unknown ones (already ended). */
  heartbeat(requestIds: readonly string[]): HeartbeatOutcome {
    let extended = 0
    for (const id of requestIds) if (this.#table.heartbeat(id)) extended++
    return { extended, unknown: requestIds.length - extended }
  }

  release(requestId: string): boolean {
    return this.#table.release(requestId)
  }

  /** This agent's clock in seconds: the handshake's reading for the decoder's offset. */
  clockSeconds(): number {
    return this.#clock.monotonic() / 1000
  }

  start(): void {
    this.#table.start()
  }

  /** Stops the reaper; leases stay (an engine that re-attaches keeps them). */
  stop(): void {
    this.#table.stop()
  }

  /** Ends every lease as released (the engine detached or was replaced). */
  releaseAll(): number {
    let n = 0
    for (const id of [...this.#ids()]) if (this.#table.release(id)) n++
    return n
  }

  reap(): number {
    return this.#table.reap()
  }

  *#ids(): Iterable<string> {
    const ids = new Set(this.#owner.values())
    yield* ids
  }
}

/**
 * A prefiller's incoming NIXL notification: `HB:<id>,<id>,…` (heartbeat, P-side ids),
 * `<id>:<consumers>` (read done, vLLM's), or `GU:<id>` (one of our decoders' agents gave up a
 * failed pull, once it was quiescent: a consumer done without reading). Anything else is not
 * ours (returns undefined).
 */
export type PrefillNotification = { kind: 'heartbeat'; ids: string[] } | { kind: 'read_done'; id: string } | { kind: 'gave_up'; id: string }

export function parsePrefillNotification(message: string): PrefillNotification | undefined {
  if (message.startsWith('HB:')) {
    const ids = message.slice(3).split(',').filter((s) => s !== '')
    return ids.length > 0 ? { kind: 'heartbeat', ids } : undefined
  }
  if (message.startsWith('GU:')) return message.length > 3 ? { kind: 'gave_up', id: message.slice(3) } : undefined
  // The id itself may contain ':' (vLLM ids do not, ours might): split on the last one.
  const at = message.lastIndexOf(':')
  if (at <= 0) return undefined
  const n = message.slice(at + 1)
  if (!/^[0-9]+$/.test(n)) return undefined
  return { kind: 'read_done', id: message.slice(0, at) }
}
