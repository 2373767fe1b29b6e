import type { Clock } from '../../../common/clock.js'
import type { PeerAliveEvent, PeerGoneEvent, RouterEvent, SnapshotEvent } from '../../../schemas/events.js'
import { type Delivery, type EventInput, EventLog, type LoggedEvent, type LogStats, type PeerAliveInput, type PeerGoneInput } from '../events/event-log.js'

/**
 * The store seam for the router's event log (DESIGN "State store", issue 10): the same
 * contract as the in-memory `EventLog`, asynchronous because the Redis implementation is.
 * Several routers on one Redis share one log: one sequence, one order, one set of acks; a
 * restarted router keeps the log and its id, so agents resume instead of starting over.
 * `test/store/event-store.contract.ts` is the contract both implementations pass.
 */
export interface EventStore {
  /** The log's identity; agents that see another one start over from 0. Durable stores keep it across restarts. */
  readonly id: string
  /** The last sequence logged (0 when none). */
  last(): Promise<number>
  /** The oldest sequence still held (last + 1 when empty). */
  first(): Promise<number>
  /** Logs an event for `expected` agents; every subscriber (of every router sharing the store) sees it. */
  append(input: EventInput, expected: readonly string[]): Promise<LoggedEvent>
  /**
   * A `peer_gone` naming only those of its engine_ids not already gone, checked and logged in
   * one step (across every router sharing the store); undefined when every one was gone.
   */
  appendPeerGone(input: PeerGoneInput, expected: readonly string[]): Promise<PeerGoneEvent | undefined>
  /**
   * A `peer_alive` naming only those of its engine_ids still gone, which stop being gone, in
   * one step (across every router sharing the store); undefined when none was.
   */
  appendPeerAlive(input: PeerAliveInput, expected: readonly string[]): Promise<PeerAliveEvent | undefined>
  /** The events after `after`, a snapshot first when some of them are no longer held; at most `limit` (a snapshot counts). */
  since(after: number, limit?: number): Promise<RouterEvent[]>
  /** Every engine_id still remembered as gone; its seq is the one just before the oldest held. */
  snapshot(): Promise<SnapshotEvent>
  /** Whether `engineId` was declared gone within goneTtlMs. */
  isGone(engineId: string): Promise<boolean>
  /** The latest held peer_gone naming every one of `engineIds`. */
  lastPeerGone(engineIds: readonly string[]): Promise<PeerGoneEvent | undefined>
  /** `agentId` applied everything up to `seq` (ignored past the last sequence or below an earlier ack). */
  ack(agentId: string, seq: number): Promise<void>
  acked(agentId: string): Promise<number>
  delivery(seq: number): Promise<Delivery | undefined>
  /** Held events still waiting for an acknowledgement from one of `agents`. */
  undelivered(agents: ReadonlySet<string>): Promise<number>
  /** What the delivery bookkeeping holds: each part is bounded (deliveryEntries, ackFloor, retention). */
  stats(): Promise<LogStats>
  /**
   * Live events, in sequence order, each once per listener: every event logged after this
   * call returns is delivered (an event logged before it may be too; callers that replay
   * with `since` drop repeats by seq). A listener that fell behind retention gets a snapshot
   * in place of what it missed.
   */
  subscribe(listener: EventListener): () => void
  /**
   * Whether a failure of this store's is worth trying again (the store away or failing over),
   * as opposed to one that would fail the same way every time (a bug, a script Redis refuses).
   */
  retryable(err: unknown): boolean
  /** Stops live delivery and releases what the store opened (not clients it was given). */
  close(): Promise<void>
}

export type EventListener = (event: LoggedEvent | SnapshotEvent) => void

export interface EventStoreOptions {
  clock: Clock
  /** Events kept for resuming agents (default 10,000). */
  retention?: number
  /** How long a gone engine_id stays in snapshots, ms (default 10 min, the agents' tombstone). */
  goneTtlMs?: number
  /**
   * Called once per event when its last expected agent acknowledged it (delivery metrics);
   * with a shared store, by the router that took that ack.
   */
  onDelivered?: (event: LoggedEvent, ms: number) => void
  /**
   * Expected agents the delivery bookkeeping may hold, summed over the distinct agent lists of
   * the held events (events for the same agents share one). Past it the oldest events go, as
   * past retention; the newest is always kept. Default 1,048,576.
   */
  deliveryEntries?: number
  /** Acks of agents no held event is for are forgotten once more than this many are on record (default 1024). */
  ackFloor?: number
}

/** The zero-install default for one router: `EventLog` behind the async seam. */
export class MemoryEventStore implements EventStore {
  readonly #log: EventLog

  constructor(opts: EventStoreOptions & { id?: string }) {
    this.#log = new EventLog(opts)
  }

  get id(): string {
    return this.#log.id
  }

  async last(): Promise<number> {
    return this.#log.last
  }

  async first(): Promise<number> {
    return this.#log.first
  }

  async append(input: EventInput, expected: readonly string[]): Promise<LoggedEvent> {
    return this.#log.append(input, expected)
  }

  async appendPeerGone(input: PeerGoneInput, expected: readonly string[]): Promise<PeerGoneEvent | undefined> {
    return this.#log.appendPeerGone(input, expected)
  }

  async appendPeerAlive(input: PeerAliveInput, expected: readonly string[]): Promise<PeerAliveEvent | undefined> {
    return this.#log.appendPeerAlive(input, expected)
  }

  async since(after: number, limit?: number): Promise<RouterEvent[]> {
    return this.#log.since(after, limit)
  }

  async snapshot(): Promise<SnapshotEvent> {
    return this.#log.snapshot()
  }

  async isGone(engineId: string): Promise<boolean> {
    return this.#log.isGone(engineId)
  }

  async lastPeerGone(engineIds: readonly string[]): Promise<PeerGoneEvent | undefined> {
    return this.#log.lastPeerGone(engineIds)
  }

  async ack(agentId: string, seq: number): Promise<void> {
    this.#log.ack(agentId, seq)
  }

  async acked(agentId: string): Promise<number> {
    return this.#log.acked(agentId)
  }

  async delivery(seq: number): Promise<Delivery | undefined> {
    return this.#log.delivery(seq)
  }

  async undelivered(agents: ReadonlySet<string>): Promise<number> {
    return this.#log.undelivered(agents)
  }

  async stats(): Promise<LogStats> {
    return this.#log.stats
  }

  subscribe(listener: EventListener): () => void {
    return this.#log.subscribe(listener)
  }

  /** Memory never goes away: whatever failed will fail again. */
  retryable(_err: unknown): boolean {
    return false
  }

  async close(): Promise<void> {}
}
