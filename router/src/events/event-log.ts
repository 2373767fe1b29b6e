import { randomUUID } from 'node:crypto'
import type { Clock } from '../../../common/clock.js'
import type { LeaseReleaseEvent, PeerGoneEvent, RouterEvent, SnapshotEvent } from '../../../schemas/events.js'

/**
 * The router's one ordered log of events for the agents (DESIGN "Events"). Every event gets
 * the next sequence number; agents resume after the last one they applied and acknowledge
 * what they applied, which is what `delivery(seq)` reports. Retention is bounded by count:
 * an agent that asks for a sequence the log no longer holds gets a snapshot first (every
 * engine_id still remembered as gone), then what the log holds.
 *
 * In memory here; the Redis implementation (issue 10) keeps the same contract.
 */
export type PeerGoneInput = Omit<PeerGoneEvent, 'seq' | 'at'>
export type LeaseReleaseInput = Omit<LeaseReleaseEvent, 'seq' | 'at'>
export type EventInput = PeerGoneInput | LeaseReleaseInput
export type LoggedEvent = PeerGoneEvent | LeaseReleaseEvent

export interface Delivery {
  seq: number
  type: LoggedEvent['type']
  /** Agents that acknowledged this sequence (or a later one). */
  applied: string[]
  /** Agents the event was for when it was logged. */
  expected: string[]
}

export interface EventLogOptions {
  clock: Clock
  /**
   * Names this log's sequence: an agent that sees another id (a router restarted with an
   * in-memory log) starts over from 0 instead of resuming after a number that names other
   * events here. Default: a random UUID per log.
   */
  id?: string
  /** Events kept for resuming agents (default 10,000). */
  retention?: number
  /** How long a gone engine_id stays in snapshots, ms (default 10 min, the agents' tombstone). */
  goneTtlMs?: number
  /** Called once per event when the last expected agent acknowledged it (delivery metrics). */
  onDelivered?: (event: LoggedEvent, ms: number) => void
}

interface Entry {
  event: LoggedEvent
  expected: readonly string[]
  /** Expected agents that have not acknowledged it yet; empty: delivered. */
  waiting: Set<string>
}

export class EventLog {
  readonly id: string
  readonly #clock: Clock
  readonly #retention: number
  readonly #goneTtlMs: number
  readonly #onDelivered: EventLogOptions['onDelivered']
  #entries: Entry[] = []
  #seq = 0
  /** Gone engine_id → when (wall ms); insertion order is age order. */
  readonly #gone = new Map<string, number>()
  /** Agent → the last sequence it acknowledged. */
  readonly #acks = new Map<string, number>()
  readonly #listeners = new Set<(event: LoggedEvent) => void>()

  constructor(opts: EventLogOptions) {
    this.id = opts.id ?? randomUUID()
    this.#clock = opts.clock
    this.#retention = opts.retention ?? 10_000
    this.#goneTtlMs = opts.goneTtlMs ?? 10 * 60_000
    this.#onDelivered = opts.onDelivered
    if (!(Number.isInteger(this.#retention) && this.#retention > 0)) throw new RangeError(`retention must be a positive integer, got ${this.#retention}`)
  }

  get last(): number {
    return this.#seq
  }

  /** The oldest sequence still held (last + 1 when empty). */
  get first(): number {
    return this.#entries[0]?.event.seq ?? this.#seq + 1
  }

  get size(): number {
    return this.#entries.length
  }

  /** Appends an event for `expected` agents; listeners (open streams) see it at once. */
  append(input: EventInput, expected: readonly string[]): LoggedEvent {
    const event = { ...input, seq: ++this.#seq, at: this.#clock.now() } as LoggedEvent
    if (event.type === 'peer_gone') {
      for (const id of event.engineIds) {
        this.#gone.delete(id)
        this.#gone.set(id, event.at)
      }
      this.#pruneGone()
    }
    this.#entries.push({ event, expected: [...expected], waiting: new Set(expected) })
    if (this.#entries.length > this.#retention) this.#entries = this.#entries.slice(this.#entries.length - this.#retention)
    for (const fn of [...this.#listeners]) fn(event)
    return event
  }

  /**
   * A `peer_gone` naming only those of `input.engineIds` not already gone; nothing is logged
   * (undefined) when every one was. Check and append are one step, so two callers declaring
   * the same engine gone log it once.
   */
  appendPeerGone(input: PeerGoneInput, expected: readonly string[]): PeerGoneEvent | undefined {
    const fresh = input.engineIds.filter((id) => !this.isGone(id))
    if (fresh.length === 0) return undefined
    return this.append({ ...input, engineIds: fresh }, expected) as PeerGoneEvent
  }

  /**
   * What an agent that applied everything up to `after` needs: the events after it, with a
   * snapshot first when some of them are no longer held.
   */
  since(after: number): RouterEvent[] {
    const out: RouterEvent[] = []
    if (after < this.first - 1) out.push(this.snapshot())
    for (const e of this.#entries) if (e.event.seq > after) out.push(e.event)
    return out
  }

  /** The state that replaces events no longer held; its seq is the one just before the oldest held. */
  snapshot(): SnapshotEvent {
    this.#pruneGone()
    return { seq: this.first - 1, type: 'snapshot', goneEngineIds: [...this.#gone.keys()], at: this.#clock.now() }
  }

  /** Whether `engineId` was declared gone recently (a repeated peer_gone is a no-op). */
  isGone(engineId: string): boolean {
    this.#pruneGone()
    return this.#gone.has(engineId)
  }

  /** The latest peer_gone naming every one of `engineIds`, if still held (for idempotent answers). */
  lastPeerGone(engineIds: readonly string[]): PeerGoneEvent | undefined {
    for (let i = this.#entries.length - 1; i >= 0; i--) {
      const e = (this.#entries[i] as Entry).event
      if (e.type === 'peer_gone' && engineIds.every((id) => e.engineIds.includes(id))) return e
    }
    return undefined
  }

  ack(agentId: string, seq: number): void {
    if (seq > this.#seq) return // an agent cannot have applied what was never logged
    const before = this.#acks.get(agentId) ?? 0
    if (seq <= before) return
    this.#acks.set(agentId, seq)
    // Only the events this ack newly covers: the cost follows the acks, not the log's size.
    for (let i = this.#indexAfter(before); i < this.#entries.length; i++) {
      const e = this.#entries[i] as Entry
      if (e.event.seq > seq) break
      if (e.waiting.delete(agentId) && e.waiting.size === 0) this.#onDelivered?.(e.event, this.#clock.now() - e.event.at)
    }
  }

  /** Index of the first held entry with seq > `seq` (entries are in seq order). */
  #indexAfter(seq: number): number {
    let lo = 0
    let hi = this.#entries.length
    while (lo < hi) {
      const mid = (lo + hi) >> 1
      if ((this.#entries[mid] as Entry).event.seq <= seq) lo = mid + 1
      else hi = mid
    }
    return lo
  }

  /** Held events still waiting for an acknowledgement from one of `agents`. */
  undelivered(agents: ReadonlySet<string>): number {
    let n = 0
    for (const e of this.#entries) {
      for (const a of e.waiting) {
        if (agents.has(a)) {
          n++
          break
        }
      }
    }
    return n
  }

  acked(agentId: string): number {
    return this.#acks.get(agentId) ?? 0
  }

  delivery(seq: number): Delivery | undefined {
    const entry = this.#entries.find((e) => e.event.seq === seq)
    if (!entry) return undefined
    return {
      seq,
      type: entry.event.type,
      expected: [...entry.expected],
      applied: entry.expected.filter((a) => (this.#acks.get(a) ?? 0) >= seq),
    }
  }

  subscribe(fn: (event: LoggedEvent) => void): () => void {
    this.#listeners.add(fn)
    return () => this.#listeners.delete(fn)
  }

  #pruneGone(): void {
    const cutoff = this.#clock.now() - this.#goneTtlMs
    for (const [id, at] of this.#gone) {
      if (at > cutoff) break
      this.#gone.delete(id)
    }
  }
}
