import { randomUUID } from 'node:crypto'
import type { Clock } from '../../../common/clock.js'
import type { LeaseReleaseEvent, PeerAliveEvent, PeerGoneEvent, RouterEvent, SnapshotEvent } from '../../../schemas/events.js'

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
export type PeerAliveInput = Omit<PeerAliveEvent, 'seq' | 'at'>
export type LeaseReleaseInput = Omit<LeaseReleaseEvent, 'seq' | 'at'>
export type EventInput = PeerGoneInput | PeerAliveInput | LeaseReleaseInput
export type LoggedEvent = PeerGoneEvent | PeerAliveEvent | LeaseReleaseEvent

/** The engine_ids an event names (Delivery.engineIds). */
export function engineIdsOf(event: LoggedEvent): string[] {
  return event.type === 'lease_release' ? [event.prefillEngineId] : [...event.engineIds]
}

export interface Delivery {
  seq: number
  type: LoggedEvent['type']
  /** The engine_ids it names: those declared gone or alive, or the prefiller whose leases it released. */
  engineIds: string[]
  /** Agents that acknowledged this sequence (or a later one). */
  applied: string[]
  /** Agents the event was for when it was logged. */
  expected: string[]
}

/** What the delivery bookkeeping holds now (its bounds: DESIGN "Security", issue 18 item 3). */
export interface LogStats {
  /** Events held. */
  events: number
  /** Expected agents, summed over the distinct lists the held events share. */
  tracked: number
  /** Agents with an acknowledgement on record. */
  acks: number
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
  /**
   * Expected agents the delivery bookkeeping may hold, summed over the distinct lists of the
   * held events (default 1,048,576). Past it the oldest events go, as past retention; the
   * newest is always kept.
   */
  deliveryEntries?: number
  /**
   * Acknowledgements kept for agents no held event is for: once more agents than this (or
   * twice `tracked`) have one on record, theirs are forgotten (default 1024).
   */
  ackFloor?: number
}

/**
 * The agents an event is for. Events logged for the same list (a peer_gone for every agent,
 * again and again) share one: held once, counted once.
 */
interface Roster {
  readonly ids: readonly string[]
  /** For membership; built on the first acknowledgement that needs it. */
  set: Set<string> | undefined
  /** Held events that share it. */
  events: number
}

interface Entry {
  event: LoggedEvent
  roster: Roster
  /** Expected agents that have not acknowledged it yet; 0: delivered (or for nobody). */
  left: number
}

/** Rosters kept to be shared by the next events (a peer_gone's and a lease_release's alternate). */
const RECENT_ROSTERS = 8

export class EventLog {
  readonly id: string
  readonly #clock: Clock
  readonly #retention: number
  readonly #goneTtlMs: number
  readonly #onDelivered: EventLogOptions['onDelivered']
  readonly #deliveryEntries: number
  readonly #ackFloor: number
  /** Held entries are #entries[#head..]; the head moves instead of the array shifting. */
  #entries: Entry[] = []
  #head = 0
  #tracked = 0
  #recent: Roster[] = []
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
    this.#deliveryEntries = opts.deliveryEntries ?? 1 << 20
    this.#ackFloor = opts.ackFloor ?? 1024
    if (!(Number.isInteger(this.#retention) && this.#retention > 0)) throw new RangeError(`retention must be a positive integer, got ${this.#retention}`)
    if (!(Number.isInteger(this.#deliveryEntries) && this.#deliveryEntries > 0)) throw new RangeError(`deliveryEntries must be a positive integer, got ${this.#deliveryEntries}`)
  }

  get stats(): LogStats {
    return { events: this.size, tracked: this.#tracked, acks: this.#acks.size }
  }

  get last(): number {
    return this.#seq
  }

  /** The oldest sequence still held (last + 1 when empty). */
  get first(): number {
    return this.#entries[this.#head]?.event.seq ?? this.#seq + 1
  }

  get size(): number {
    return this.#entries.length - this.#head
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
    if (event.type === 'peer_alive') for (const id of event.engineIds) this.#gone.delete(id)
    const roster = this.#roster(expected)
    this.#entries.push({ event, roster, left: roster.ids.length })
    while (this.size > this.#retention || (this.#tracked > this.#deliveryEntries && this.size > 1)) this.#dropOldest()
    for (const fn of [...this.#listeners]) fn(event)
    return event
  }

  /** The roster for `expected`: a recent one with the same agents, or a new one. */
  #roster(expected: readonly string[]): Roster {
    const ids = [...new Set(expected)]
    let roster = this.#recent.find((r) => r.ids.length === ids.length && r.ids.every((id, i) => id === ids[i]))
    if (!roster) {
      roster = { ids, set: undefined, events: 0 }
      this.#recent.push(roster)
      if (this.#recent.length > RECENT_ROSTERS) this.#recent.shift()
    }
    if (roster.events++ === 0) this.#tracked += roster.ids.length
    return roster
  }

  #dropOldest(): void {
    const e = this.#entries[this.#head] as Entry
    this.#entries[this.#head] = undefined as unknown as Entry
    this.#head++
    // Amortised: the array is cut once the dropped head is most of it.
    if (this.#head > 1024 && this.#head * 2 > this.#entries.length) {
      this.#entries = this.#entries.slice(this.#head)
      this.#head = 0
    }
    if (--e.roster.events === 0) {
      this.#tracked -= e.roster.ids.length
      e.roster.set = undefined
    }
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
   * A `peer_alive` naming only those of `input.engineIds` still gone, which stop being gone
   * (a later peer_gone for them logs again); undefined when none was. One step, as
   * appendPeerGone.
   */
  appendPeerAlive(input: PeerAliveInput, expected: readonly string[]): PeerAliveEvent | undefined {
    const gone = input.engineIds.filter((id) => this.isGone(id))
    if (gone.length === 0) return undefined
    return this.append({ ...input, engineIds: gone }, expected) as PeerAliveEvent
  }

  /**
   * What an agent that applied everything up to `after` needs: the events after it, with a
   * snapshot first when some of them are no longer held; at most `limit` (a snapshot counts).
   */
  since(after: number, limit = Infinity): RouterEvent[] {
    const out: RouterEvent[] = []
    if (after < this.first - 1) out.push(this.snapshot())
    for (let i = this.#indexAfter(after); i < this.#entries.length && out.length < limit; i++) out.push((this.#entries[i] as Entry).event)
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
    for (let i = this.#entries.length - 1; i >= this.#head; i--) {
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
    // Each is covered once per agent (acks only move forward), so `left` counts each agent once.
    for (let i = this.#indexAfter(before); i < this.#entries.length; i++) {
      const e = this.#entries[i] as Entry
      if (e.event.seq > seq) break
      if (e.left > 0 && isIn(e.roster, agentId) && --e.left === 0) this.#onDelivered?.(e.event, this.#clock.now() - e.event.at)
    }
    if (this.#acks.size > Math.max(this.#ackFloor, 2 * this.#tracked)) this.#forgetAcks()
  }

  /**
   * Forgets the acks of agents no held event is for (agents long gone from the directory).
   * Safe for delivery: an ack that comes again covers only events whose roster lacks them.
   */
  #forgetAcks(): void {
    const expected = new Set<string>()
    for (let i = this.#head; i < this.#entries.length; i++) for (const id of (this.#entries[i] as Entry).roster.ids) expected.add(id)
    for (const a of this.#acks.keys()) if (!expected.has(a)) this.#acks.delete(a)
  }

  /** Index of the first held entry with seq > `seq` (entries are in seq order). */
  #indexAfter(seq: number): number {
    let lo = this.#head
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
    if (agents.size === 0) return 0
    // Only what lies after the slowest of them can still wait for one of them.
    const slowest = Math.min(...[...agents].map((a) => this.#acks.get(a) ?? 0))
    let n = 0
    for (let i = this.#indexAfter(slowest); i < this.#entries.length; i++) {
      const e = this.#entries[i] as Entry
      if (e.left === 0) continue
      for (const a of agents) {
        if ((this.#acks.get(a) ?? 0) < e.event.seq && isIn(e.roster, a)) {
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
    const entry = this.#entries[this.#indexAfter(seq - 1)]
    if (!entry || entry.event.seq !== seq) return undefined
    const { ids } = entry.roster
    return {
      seq,
      type: entry.event.type,
      engineIds: engineIdsOf(entry.event),
      expected: [...ids],
      applied: ids.filter((a) => (this.#acks.get(a) ?? 0) >= seq),
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

function isIn(roster: Roster, agentId: string): boolean {
  if (roster.ids.length < 16) return roster.ids.includes(agentId)
  roster.set ??= new Set(roster.ids)
  return roster.set.has(agentId)
}
