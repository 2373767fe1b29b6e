import { encode } from '@msgpack/msgpack'
import type { Logger } from 'pino'
import type { Clock } from '../../common/clock.js'
import { END_SEQUENCE, sequenceFrame } from '../../common/kv-sequence.js'
import type { KvEventsConfig } from '../../schemas/kv-events.js'
import type { BlockEvent } from './block-pool.js'

/*
 * The pool's KV events on the wire as vLLM 0.32 sends them (vllm/distributed/kv_events.py,
 * ZmqEventPublisher):
 *
 * - PUB socket, one message per batch: three frames, the topic, the sequence number as 8
 *   bytes big-endian, and msgpack of the EventBatch `[ts, events, data_parallel_rank]` (a
 *   msgspec array-like struct). Each event is a map tagged by `type` (BlockStored,
 *   BlockRemoved, AllBlocksCleared), defaults omitted; block hashes are unsigned 64-bit ints
 *   (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES, on by default).
 * - Replay (ROUTER socket, `replay_endpoint`): a request of one frame, the first sequence
 *   wanted (8 bytes big-endian), is answered with every buffered batch from there, each as
 *   `(identity, "", topic, seq, payload)`, then `(identity, "", "", -1 as 8 signed bytes, "")`.
 *   A subscriber that saw a gap asks for what it missed.
 * - The events of one engine step go out as one batch; here, those of one turn of the event
 *   loop.
 */

/** The events as msgspec writes them: maps with `type`, fields at their default left out. */
function wireEvent(e: BlockEvent, blockSize: number): Record<string, unknown> {
  switch (e.type) {
    case 'BlockStored':
      return {
        type: 'BlockStored',
        block_hashes: e.blockHashes,
        parent_block_hash: e.parentBlockHash,
        token_ids: e.tokenIds,
        block_size: blockSize,
        lora_id: null,
        medium: 'GPU',
        lora_name: null,
        group_idx: 0,
      }
    case 'BlockRemoved':
      return { type: 'BlockRemoved', block_hashes: e.blockHashes, medium: 'GPU', group_idx: 0 }
    case 'AllBlocksCleared':
      return { type: 'AllBlocksCleared' }
  }
}

/**
 * vLLM's offset_endpoint_port: data-parallel rank r publishes on the endpoint's port + r
 * (ipc/inproc: a `_dp<r>` suffix; port 0 stays 0).
 */
export function offsetEndpoint(endpoint: string, rank: number): string {
  if (rank === 0) return endpoint
  if (!endpoint.startsWith('tcp://')) return `${endpoint}_dp${rank}`
  const m = /^(tcp:\/\/.*):(\d+)$/.exec(endpoint)
  if (!m) return endpoint
  const port = Number(m[2])
  return port === 0 ? endpoint : `${m[1] as string}:${port + rank}`
}

/** vLLM's rule: wildcard, ipc and inproc endpoints are bound; the rest are connected to. */
const isBind = (endpoint: string): boolean => endpoint.includes('*') || endpoint.includes('::') || /^(ipc|inproc):\/\//.test(endpoint)

/**
 * Where to bind. vLLM binds `tcp://*:0` to the node's IP and a free port; the simulator binds
 * it to its own `--host` (the address it serves on), so tests stay on loopback.
 */
function bindAddress(endpoint: string, host: string): string {
  return endpoint === 'tcp://*:0' ? `tcp://${host.includes(':') ? `[${host}]` : host}:*` : endpoint
}

export interface KvEventPublisherOptions {
  config: KvEventsConfig
  /** SimConfig.host: where `tcp://*:0` binds. */
  host: string
  dataParallelRank: number
  blockSize: number
  clock: Clock
  log: Logger
}

type Zmq = typeof import('zeromq')

/** Publishes a pool's events (one instance per engine's pool). */
export class KvEventPublisher {
  readonly #o: KvEventPublisherOptions
  readonly #pub: InstanceType<Zmq['Publisher']>
  readonly #replay: InstanceType<Zmq['Router']> | undefined
  readonly #topic: Buffer
  readonly #buffer: { seq: bigint; payload: Uint8Array }[] = []
  #pending: BlockEvent[] = []
  #seq = 0n
  #sending: Promise<void> = Promise.resolve()
  #dropped = 0
  #closed = false
  /** The bound (or connected) endpoints, ports resolved. */
  endpoint = ''
  replayEndpoint: string | undefined

  private constructor(o: KvEventPublisherOptions, zmq: Zmq) {
    this.#o = o
    this.#topic = Buffer.from(o.config.topic, 'utf8')
    this.#pub = new zmq.Publisher({ sendHighWaterMark: o.config.hwm, linger: 0 })
    this.#replay = o.config.replay_endpoint === null ? undefined : new zmq.Router({ linger: 0 })
  }

  /** Binds (or connects) the sockets; zeromq's native module loads only when events are on. */
  static async open(o: KvEventPublisherOptions): Promise<KvEventPublisher> {
    const zmq = await import('zeromq')
    const p = new KvEventPublisher(o, zmq)
    try {
      const endpoint = offsetEndpoint(o.config.endpoint, o.dataParallelRank)
      if (isBind(endpoint)) {
        await p.#pub.bind(bindAddress(endpoint, o.host))
        p.endpoint = p.#pub.lastEndpoint ?? endpoint
      } else {
        p.#pub.connect(endpoint)
        p.endpoint = endpoint
      }
      if (p.#replay && o.config.replay_endpoint !== null) {
        await p.#replay.bind(bindAddress(offsetEndpoint(o.config.replay_endpoint, o.dataParallelRank), o.host))
        p.replayEndpoint = p.#replay.lastEndpoint ?? undefined
        void p.#serveReplay()
      }
    } catch (err) {
      p.#pub.close()
      p.#replay?.close()
      throw err
    }
    return p
  }

  /** Events published so far (the next batch's sequence number). */
  get sequence(): bigint {
    return this.#seq
  }

  /** Events dropped because max_queue_size were already waiting. */
  get dropped(): number {
    return this.#dropped
  }

  /** Queues one event; the turn's events go out as one batch. */
  emit(event: BlockEvent): void {
    if (this.#closed) return
    if (this.#pending.length >= this.#o.config.max_queue_size) {
      if (this.#dropped++ === 0) this.#o.log.warn({ maxQueueSize: this.#o.config.max_queue_size }, 'KV event queue full: dropping events (a subscriber sees a gap and replays)')
      return
    }
    // The turn's first event schedules the flush of all of them.
    if (this.#pending.push(event) === 1) setImmediate(() => this.#flush())
  }

  #flush(): void {
    const events = this.#pending
    this.#pending = []
    if (events.length === 0 || this.#closed) return
    const batch = [this.#o.clock.now() / 1000, events.map((e) => wireEvent(e, this.#o.blockSize)), this.#o.dataParallelRank]
    // useBigInt64: hashes (BigInt) as msgpack's 64-bit ints.
    const payload = encode(batch, { useBigInt64: true })
    const seq = this.#seq++
    this.#buffer.push({ seq, payload })
    if (this.#buffer.length > this.#o.config.buffer_steps) this.#buffer.shift()
    this.#send(this.#pub, [this.#topic, sequenceFrame(seq), payload])
  }

  /** zeromq allows one send in flight per socket: sends queue behind each other. */
  #send(socket: { send(frames: (Buffer | Uint8Array)[]): Promise<void> }, frames: (Buffer | Uint8Array)[]): void {
    this.#sending = this.#sending
      .then(() => socket.send(frames))
      .catch((err: unknown) => {
        if (!this.#closed) this.#o.log.warn({ err }, 'publishing a KV event batch failed')
      })
  }

  async #serveReplay(): Promise<void> {
    const replay = this.#replay
    if (!replay) return
    try {
      for await (const frames of replay) {
        const [id, , start] = frames
        if (frames.length !== 3 || !id || !start || start.length !== 8) {
          this.#o.log.warn({ frames: frames.length }, 'invalid KV event replay request')
          continue
        }
        const from = start.readBigUInt64BE()
        for (const { seq, payload } of this.#buffer) {
          if (seq >= from) this.#send(replay, [id, Buffer.alloc(0), this.#topic, sequenceFrame(seq), payload])
        }
        this.#send(replay, [id, Buffer.alloc(0), Buffer.alloc(0), sequenceFrame(END_SEQUENCE), Buffer.alloc(0)])
      }
    } catch (err) {
      if (!this.#closed) this.#o.log.warn({ err }, 'KV event replay socket failed')
    }
  }

  async close(): Promise<void> {
    if (this.#closed) return
    this.#flush()
    this.#closed = true
    await this.#sending
    this.#pub.close()
    this.#replay?.close()
  }
}


/** The replay's end marker: -1 as 8 signed big-endian bytes. */
