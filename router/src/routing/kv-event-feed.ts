import type { FastifyBaseLogger } from 'fastify'
import type { Dealer, Subscriber } from 'zeromq'
import { END_SEQUENCE, sequenceFrame } from '../../../common/kv-sequence.js'
import { decodeKvBatch, KvEventsWireError, readSequence } from './kv-events-wire.js'
import type { Applied, PrefixIndex } from './prefix-index.js'

/*
 * One engine's KV events into the prefix index (issue 39 part 2): a SUB socket on the engine's
 * `endpoint`, and a DEALER on its `replay_endpoint` to fill gaps, as vLLM 0.32's
 * ZmqEventPublisher serves them (vllm/distributed/kv_events.py `_service_replay`: a request
 * `["", start_seq]`, answered by every buffered batch from there as `["", topic, seq, payload]`,
 * then `["", "", -1, ""]`).
 *
 * What the index may believe:
 * - Joining late is safe: blocks stored before it joined are unknown (a lower prediction,
 *   never a false hit), so the feed asks for the publisher's whole buffer once, from 0.
 * - A gap is not: the lost batches may hold BlockRemoved, and the index would send prompts to
 *   blocks that are gone. A gap is replayed; if the replay cannot fill it (the publisher's
 *   buffer moved past it, no replay endpoint, no answer in time) or a batch cannot be read,
 *   the engine's index is purged and built again from what follows.
 * - Live batches that arrive while a replay runs are held and applied after it, in order.
 * - The SUB socket's receive high-water mark bounds what waits in this process; past it ZMQ
 *   drops, which is a gap like any other.
 * - One publisher's live batches reach a SUB socket in rising order. One at or below the last
 *   live one means the publisher started over (an engine restarted at the same endpoint counts
 *   from 0 again; batches that a replay already applied may still arrive live, but those rise):
 *   what the index holds of the engine went with it, so the index is purged and follows the
 *   new sequence, from a replay of what the new publisher holds. (A restart the feed cannot
 *   see, the new publisher past the old one's sequence before the feed reconnects, is seen by
 *   the router as a new engine_id, which purges the index too.)
 */

export interface KvEventFeedOptions {
  /** The index key: the engine (an instance id, with its data-parallel rank past rank 0). */
  key: string
  endpoint: string
  replayEndpoint?: string | undefined
  topic?: string
  index: PrefixIndex
  log: Pick<FastifyBaseLogger, 'warn'>
  /** How long a replay may take before the gap counts as unfillable. */
  replayTimeoutMs?: number
  /** Batches held by the SUB socket before ZMQ drops (default 10,000). */
  receiveHighWaterMark?: number
  /** Each batch applied (for metrics). */
  onApplied?: (applied: Applied) => void
  /** The engine's index was purged (for metrics). */
  onPurged?: (reason: FeedPurge) => void
}

/** Why a feed purged its engine's index: a gap replay could not fill, a batch it could not read, the publisher started over. */
export type FeedPurge = 'gap' | 'unreadable' | 'restart'

export interface KvEventFeedStats {
  batches: number
  gaps: number
  replays: number
  /** The index was purged: a gap that could not be filled, a batch that could not be read, a restart. */
  purges: number
  /** The publisher's sequence started over (the engine restarted). */
  restarts: number
  wireErrors: number
}

type Zmq = typeof import('zeromq')


export class KvEventFeed {
  readonly #o: KvEventFeedOptions
  readonly #sub: Subscriber
  readonly #zmq: Zmq
  #dealer: Dealer | undefined
  /** The last sequence applied; undefined before the first. */
  #last: bigint | undefined
  /** The last batch read from the SUB socket (live, not replayed). */
  #lastLive: bigint | undefined
  #replaying = false
  #held: { seq: bigint; payload: Buffer }[] = []
  #closed = false
  readonly stats: KvEventFeedStats = { batches: 0, gaps: 0, replays: 0, purges: 0, restarts: 0, wireErrors: 0 }

  private constructor(o: KvEventFeedOptions, zmq: Zmq) {
    this.#o = o
    this.#zmq = zmq
    this.#sub = new zmq.Subscriber({ linger: 0, receiveHighWaterMark: o.receiveHighWaterMark ?? 10_000 })
    this.#sub.connect(o.endpoint)
    this.#sub.subscribe(o.topic ?? '')
    this.#renewDealer()
  }

  #renewDealer(): void {
    this.#dealer?.close()
    const endpoint = this.#o.replayEndpoint
    if (!endpoint) return
    this.#dealer = new this.#zmq.Dealer({ linger: 0, receiveTimeout: this.#o.replayTimeoutMs ?? 5000 })
    this.#dealer.connect(endpoint)
  }

  /** Connects (ZMQ connects lazily: an engine not up yet is dialled until it is). zeromq loads only here. */
  static async open(o: KvEventFeedOptions): Promise<KvEventFeed> {
    const feed = new KvEventFeed(o, await import('zeromq'))
    void feed.#run()
    return feed
  }

  /** The sequence of the last batch applied. */
  get sequence(): bigint | undefined {
    return this.#last
  }

  close(): void {
    this.#closed = true
    this.#sub.close()
    this.#dealer?.close()
  }

  async #run(): Promise<void> {
    // A replay of what the publisher holds, before the first live batch: it may be idle for long.
    if (this.#dealer) await this.#fill(0n, false)
    try {
      for await (const frames of this.#sub) {
        const seq = this.#sequenceOf(frames[1])
        if (seq === undefined) continue
        const live = this.#lastLive
        this.#lastLive = seq
        if (live !== undefined && seq <= live) await this.#restarted(seq, frames[2] as Buffer)
        else await this.#live(seq, frames[2] as Buffer)
      }
    } catch (err) {
      if (!this.#closed) this.#o.log.warn({ err, engine: this.#o.key }, 'KV event feed stopped')
    }
  }

  #sequenceOf(frame: Buffer | undefined): bigint | undefined {
    try {
      return readSequence(frame ?? Buffer.alloc(0))
    } catch (err) {
      this.#wireError(err)
      return undefined
    }
  }

  async #live(seq: bigint, payload: Buffer): Promise<void> {
    if (this.#replaying) {
      this.#held.push({ seq, payload })
      return
    }
    const last = this.#last
    if (last !== undefined && seq <= last) return // already applied (replayed)
    if (last !== undefined && seq > last + 1n) {
      this.stats.gaps++
      this.#held.push({ seq, payload })
      await this.#fill(last + 1n, true)
      return
    }
    this.#apply(seq, payload)
  }

  /**
   * Replays from `from`. `mustFill`: a gap, so a replay that does not start at `from` (or
   * does not answer) purges the engine's index.
   */
  async #fill(from: bigint, mustFill: boolean): Promise<void> {
    this.#replaying = true
    let filled = false
    try {
      if (this.#dealer) {
        this.stats.replays++
        await this.#dealer.send(['', sequenceFrame(from)])
        let first = true
        // Read to the end marker, whatever it holds, so the next replay starts clean.
        for (;;) {
          const frames = await this.#dealer.receive()
          const seq = this.#sequenceOf(frames[2])
          if (seq === undefined || seq === END_SEQUENCE) {
            if (first && !mustFill) filled = true // nothing buffered: nothing missed either
            break
          }
          if (first) filled = seq === from || !mustFill
          first = false
          if (filled && (this.#last === undefined || seq > this.#last)) this.#apply(seq, frames[3] as Buffer)
        }
      }
    } catch (err) {
      if (this.#closed) return
      this.#o.log.warn({ err, engine: this.#o.key, from: String(from) }, 'KV event replay failed')
      // A late answer must not be read as the next replay's: a new socket.
      this.#renewDealer()
    }
    if (mustFill && !filled) this.#purge('gap', `gap at ${from} not filled by replay`)
    this.#replaying = false
    // One publisher's batches arrive in sequence order, so the held ones already are.
    const held = this.#held
    this.#held = []
    // After a purge the index starts again from the first batch held.
    if (mustFill && !filled && held[0]) this.#last = held[0].seq - 1n
    for (const h of held) await this.#live(h.seq, h.payload)
  }

  async #restarted(seq: bigint, payload: Buffer): Promise<void> {
    this.stats.restarts++
    this.#purge('restart', `the publisher started over (batch ${seq} after ${this.#last ?? 'none'})`)
    this.#last = undefined
    // The new publisher's batches before this one, if it still holds them, then this one.
    this.#held = [{ seq, payload }]
    await this.#fill(0n, false)
  }

  #apply(seq: bigint, payload: Buffer): void {
    this.#last = seq
    this.stats.batches++
    let events
    try {
      events = decodeKvBatch(payload).events
    } catch (err) {
      this.#wireError(err)
      this.#purge('unreadable', 'a batch could not be read')
      return
    }
    const applied = this.#o.index.apply(this.#o.key, events)
    this.#o.onApplied?.(applied)
  }

  #purge(reason: FeedPurge, why: string): void {
    this.stats.purges++
    this.#o.index.purge(this.#o.key)
    this.#o.onPurged?.(reason)
    this.#o.log.warn({ engine: this.#o.key, why }, 'prefix index of the engine purged')
  }

  #wireError(err: unknown): void {
    if (this.stats.wireErrors++ === 0) this.#o.log.warn({ err: err instanceof KvEventsWireError ? err.message : err, engine: this.#o.key }, 'KV event message not understood')
  }
}
