import { randomUUID } from 'node:crypto'
import type { Redis } from 'ioredis'
import type { PeerGoneEvent, RouterEvent, SnapshotEvent } from '../../../schemas/events.js'
import type { Delivery, EventInput, LoggedEvent, PeerGoneInput } from '../events/event-log.js'
import type { EventListener, EventStore, EventStoreOptions } from './event-store.js'

/**
 * The event log in Redis (issue 10), shared by every router on it. Keys, under `prefix`
 * (default `handoff:`):
 * - `events`: a stream; entry id `<seq>-0`, fields `e` (the event as JSON, without seq) and
 *   `x` (the expected agents as JSON). Trimmed to `retention` entries (exact MAXLEN).
 * - `events:seq`: the last sequence (INCR inside the append script, so sequence order is
 *   stream order whichever router appends).
 * - `events:id`: the log's id (SET NX at open: the first router names it, restarts keep it).
 * - `events:gone`: sorted set, engine_id scored by when it was declared gone (wall ms).
 * - `events:waiting:<seq>`: set of expected agents that have not acknowledged seq yet;
 *   deleted when it empties (Redis drops empty sets) or the event is trimmed, with an expiry
 *   as a backstop.
 * - `acks`: hash, agent id → the last sequence it acknowledged.
 * Scripts name keys they derive (`waiting:<seq>`) through ARGV: fine on one Redis, not on a cluster.
 */
export interface RedisEventStoreOptions extends EventStoreOptions {
  /** Commands go through it; a duplicate does the blocking reads. The caller owns and closes it. */
  redis: Redis
  prefix?: string
  /** Expiry of the per-event waiting sets, ms (default 24 h). */
  waitingTtlMs?: number
  /** The live reader's failures (a Redis outage); it retries every `retryMs`. */
  onError?: (err: unknown) => void
  /**
   * After an outage the log turned out to be another one (Redis restarted empty): `id` and
   * the sequence start over, and every agent must too (their streams should be ended).
   */
  onReset?: (id: string) => void
  retryMs?: number
}

// KEYS: stream, seq, gone. ARGV: event JSON, expected JSON, retention, waiting-key prefix,
// waiting TTL ms, at, gone cutoff, n, n expected agents, then the engine_ids it declares gone.
const APPEND = `
local seq = redis.call('INCR', KEYS[2])
local retention = tonumber(ARGV[3])
redis.call('XADD', KEYS[1], 'MAXLEN', retention, seq .. '-0', 'e', ARGV[1], 'x', ARGV[2])
if seq > retention then redis.call('DEL', ARGV[4] .. (seq - retention)) end
local n = tonumber(ARGV[8])
if n > 0 then
  local waiting = ARGV[4] .. seq
  redis.call('SADD', waiting, unpack(ARGV, 9, 8 + n))
  redis.call('PEXPIRE', waiting, ARGV[5])
end
if #ARGV > 8 + n then
  for i = 9 + n, #ARGV do redis.call('ZADD', KEYS[3], ARGV[6], ARGV[i]) end
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', ARGV[7])
end
return seq
`

// As APPEND, for a peer_gone: first drops the engine_ids still gone (scored after the cutoff)
// from ARGV and from the event, whose JSON holds "engineIds":"${FRESH}" for the script to
// fill; logs nothing and returns {0} when none is left, else {seq, the engine_ids logged}.
const FRESH = '@fresh@'
const APPEND_PEER_GONE = `
local n = tonumber(ARGV[8])
local fresh = {}
for i = 9 + n, #ARGV do
  local at = redis.call('ZSCORE', KEYS[3], ARGV[i])
  if not at or tonumber(at) <= tonumber(ARGV[7]) then fresh[#fresh + 1] = ARGV[i] end
end
if #fresh == 0 then return {0} end
for i = #ARGV, 9 + n, -1 do table.remove(ARGV, i) end
for _, id in ipairs(fresh) do ARGV[#ARGV + 1] = id end
local i, j = string.find(ARGV[1], '"${FRESH}"', 1, true)
ARGV[1] = string.sub(ARGV[1], 1, i - 1) .. cjson.encode(fresh) .. string.sub(ARGV[1], j + 1)
local seq = (function()
${APPEND}
end)()
return {seq, unpack(fresh)}
`

// KEYS: acks, seq, stream. ARGV: agent, seq, waiting-key prefix. Returns [seq, event JSON, ...]
// for each event this ack completed (its last expected agent).
const ACK = `
local last = tonumber(redis.call('GET', KEYS[2]) or '0')
local s = tonumber(ARGV[2])
if s > last then return {} end
local before = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0')
if s <= before then return {} end
redis.call('HSET', KEYS[1], ARGV[1], s)
local head = redis.call('XRANGE', KEYS[3], '-', '+', 'COUNT', 1)
local from = before + 1
if head[1] then
  local first = tonumber(string.match(head[1][1], '^(%d+)'))
  if first > from then from = first end
end
local done = {}
for q = from, s do
  local k = ARGV[3] .. q
  if redis.call('SREM', k, ARGV[1]) == 1 and redis.call('EXISTS', k) == 0 then
    local entry = redis.call('XRANGE', KEYS[3], q .. '-0', q .. '-0')
    if entry[1] then
      done[#done + 1] = q
      done[#done + 1] = entry[1][2][2]
    end
  end
end
return done
`

type Entry = [id: string, fields: string[]]

export class RedisEventStore implements EventStore {
  #id: string
  readonly #redis: Redis
  readonly #reader: Redis
  readonly #opts: RedisEventStoreOptions
  readonly #retention: number
  readonly #goneTtlMs: number
  readonly #keys: { stream: string; seq: string; gone: string; waiting: string; acks: string; id: string }
  readonly #listeners = new Set<EventListener>()
  #cursor: number
  #closed = false
  #loop: Promise<void> | undefined

  /** Opens (or joins) the log: names it if nobody has, and starts the live reader after the last sequence. */
  static async open(opts: RedisEventStoreOptions): Promise<RedisEventStore> {
    const prefix = opts.prefix ?? 'handoff:'
    checkRetention(opts.retention)
    await opts.redis.set(`${prefix}events:id`, randomUUID(), 'NX')
    const [id, last] = await Promise.all([opts.redis.get(`${prefix}events:id`), opts.redis.get(`${prefix}events:seq`)])
    const store = new RedisEventStore(opts, prefix, id as string, Number(last ?? 0))
    store.#loop = store.#read()
    return store
  }

  private constructor(opts: RedisEventStoreOptions, prefix: string, id: string, cursor: number) {
    this.#opts = opts
    this.#retention = checkRetention(opts.retention)
    this.#goneTtlMs = opts.goneTtlMs ?? 10 * 60_000
    this.#redis = opts.redis
    this.#reader = opts.redis.duplicate()
    // The read loop reports and retries; an unheard error event would crash the process.
    this.#reader.on('error', () => {})
    this.#id = id
    this.#cursor = cursor
    this.#keys = {
      stream: `${prefix}events`,
      seq: `${prefix}events:seq`,
      gone: `${prefix}events:gone`,
      waiting: `${prefix}events:waiting:`,
      acks: `${prefix}acks`,
      id: `${prefix}events:id`,
    }
  }

  get id(): string {
    return this.#id
  }

  async last(): Promise<number> {
    return Number((await this.#redis.get(this.#keys.seq)) ?? 0)
  }

  async first(): Promise<number> {
    const [[, head], [, last]] = (await this.#redis.multi().xrange(this.#keys.stream, '-', '+', 'COUNT', 1).get(this.#keys.seq).exec()) as [[null, Entry[]], [null, string | null]]
    return head[0] ? seqOf(head[0][0]) : Number(last ?? 0) + 1
  }

  async append(input: EventInput, expected: readonly string[]): Promise<LoggedEvent> {
    const at = this.#opts.clock.now()
    const body = { ...input, at }
    const seq = (await this.#append(APPEND, body, expected, input.type === 'peer_gone' ? input.engineIds : [])) as number
    return { ...body, seq } as LoggedEvent
  }

  async appendPeerGone(input: PeerGoneInput, expected: readonly string[]): Promise<PeerGoneEvent | undefined> {
    const at = this.#opts.clock.now()
    const [seq, ...fresh] = (await this.#append(APPEND_PEER_GONE, { ...input, engineIds: FRESH, at }, expected, input.engineIds)) as [number, ...string[]]
    if (seq === 0) return undefined
    return { ...input, engineIds: fresh, at, seq }
  }

  /** Runs an append script with the arguments both take (see APPEND). */
  #append(script: string, body: { at: number } & Record<string, unknown>, expected: readonly string[], gone: readonly string[]): Promise<unknown> {
    const { at } = body
    const k = this.#keys
    return this.#redis.eval(
      script,
      3,
      k.stream,
      k.seq,
      k.gone,
      JSON.stringify(body),
      JSON.stringify(expected),
      this.#retention,
      k.waiting,
      this.#opts.waitingTtlMs ?? 24 * 3600_000,
      at,
      at - this.#goneTtlMs,
      expected.length,
      ...expected,
      ...gone,
    )
  }

  async since(after: number): Promise<RouterEvent[]> {
    const now = this.#opts.clock.now()
    const [[, head], [, rest], [, last], [, gone]] = (await this.#redis
      .multi()
      .xrange(this.#keys.stream, '-', '+', 'COUNT', 1)
      .xrange(this.#keys.stream, `${after + 1}-0`, '+')
      .get(this.#keys.seq)
      .zrangebyscore(this.#keys.gone, `(${now - this.#goneTtlMs}`, '+inf')
      .exec()) as [[null, Entry[]], [null, Entry[]], [null, string | null], [null, string[]]]
    const first = head[0] ? seqOf(head[0][0]) : Number(last ?? 0) + 1
    const out: RouterEvent[] = []
    if (after < first - 1) out.push({ seq: first - 1, type: 'snapshot', goneEngineIds: gone, at: now })
    for (const entry of rest) out.push(parse(entry))
    return out
  }

  async snapshot(): Promise<SnapshotEvent> {
    const now = this.#opts.clock.now()
    const [first, gone] = await Promise.all([this.first(), this.#goneIds(now)])
    return { seq: first - 1, type: 'snapshot', goneEngineIds: gone, at: now }
  }

  async isGone(engineId: string): Promise<boolean> {
    const at = await this.#redis.zscore(this.#keys.gone, engineId)
    return at !== null && Number(at) > this.#opts.clock.now() - this.#goneTtlMs
  }

  async lastPeerGone(engineIds: readonly string[]): Promise<PeerGoneEvent | undefined> {
    // Newest first, a page at a time: a repeat names a recent event.
    let end = '+'
    for (;;) {
      const page = (await this.#redis.xrevrange(this.#keys.stream, end, '-', 'COUNT', 100)) as Entry[]
      for (const entry of page) {
        const e = parse(entry)
        if (e.type === 'peer_gone' && engineIds.every((id) => e.engineIds.includes(id))) return e
      }
      const oldest = page.at(-1)
      if (page.length < 100 || !oldest || seqOf(oldest[0]) <= 1) return undefined
      end = `${seqOf(oldest[0]) - 1}-0`
    }
  }

  async ack(agentId: string, seq: number): Promise<void> {
    const done = (await this.#redis.eval(ACK, 3, this.#keys.acks, this.#keys.seq, this.#keys.stream, agentId, seq, this.#keys.waiting)) as (number | string)[]
    if (!this.#opts.onDelivered) return
    const now = this.#opts.clock.now()
    for (let i = 0; i < done.length; i += 2) {
      const event = { ...JSON.parse(done[i + 1] as string), seq: Number(done[i]) } as LoggedEvent
      this.#opts.onDelivered(event, now - event.at)
    }
  }

  async acked(agentId: string): Promise<number> {
    return Number((await this.#redis.hget(this.#keys.acks, agentId)) ?? 0)
  }

  async delivery(seq: number): Promise<Delivery | undefined> {
    const [entry] = (await this.#redis.xrange(this.#keys.stream, `${seq}-0`, `${seq}-0`)) as Entry[]
    if (!entry) return undefined
    const event = parse(entry)
    const expected = JSON.parse(field(entry, 'x') ?? '[]') as string[]
    const acks = expected.length > 0 ? await this.#redis.hmget(this.#keys.acks, ...expected) : []
    return { seq, type: event.type, expected, applied: expected.filter((_, i) => Number(acks[i] ?? 0) >= seq) }
  }

  async undelivered(agents: ReadonlySet<string>): Promise<number> {
    if (agents.size === 0) return 0
    const names = [...agents]
    const raw = await this.#redis.hmget(this.#keys.acks, ...names)
    const acks = new Map(names.map((a, i) => [a, Number(raw[i] ?? 0)] as const))
    // Only what lies after the slowest of them can still wait for one of them.
    const from = Math.min(...acks.values()) + 1
    const entries = (await this.#redis.xrange(this.#keys.stream, `${from}-0`, '+')) as Entry[]
    let n = 0
    for (const entry of entries) {
      const seq = seqOf(entry[0])
      const expected = JSON.parse(field(entry, 'x') ?? '[]') as string[]
      if (expected.some((a) => (acks.get(a) ?? seq) < seq)) n++
    }
    return n
  }

  subscribe(listener: EventListener): () => void {
    this.#listeners.add(listener)
    return () => {
      this.#listeners.delete(listener)
    }
  }

  async close(): Promise<void> {
    if (this.#closed) return
    this.#closed = true
    this.#reader.disconnect()
    await this.#loop
  }

  /**
   * The live reader: a blocking XREAD on its own connection, after the last sequence it
   * dispatched. Every router runs one, so each sees every router's events in stream order.
   */
  async #read(): Promise<void> {
    let failed = false
    while (!this.#closed) {
      let res: [string, Entry[]][] | null
      try {
        if (failed) await this.#rejoin()
        failed = false
        res = (await this.#reader.xread('COUNT', 500, 'BLOCK', 1000, 'STREAMS', this.#keys.stream, `${this.#cursor}-0`)) as [string, Entry[]][] | null
      } catch (err) {
        if (this.#closed) return
        failed = true
        this.#opts.onError?.(err)
        // An I/O retry, not logic under test: real time.
        await new Promise((resolve) => setTimeout(resolve, this.#opts.retryMs ?? 500))
        continue
      }
      for (const entry of res?.[0]?.[1] ?? []) {
        const seq = seqOf(entry[0])
        if (seq > this.#cursor + 1) {
          // Trimmed before this reader got to it: a snapshot stands for what it missed.
          const now = this.#opts.clock.now()
          this.#dispatch({ seq: seq - 1, type: 'snapshot', goneEngineIds: await this.#goneIds(now), at: now })
        }
        this.#cursor = seq
        this.#dispatch(parse(entry))
      }
    }
  }

  /**
   * Back after an outage: is it still the same log? Redis restarted empty has no id (the
   * first router back names a new one) and a sequence behind this reader's: everything
   * starts over from the new log's current end.
   */
  async #rejoin(): Promise<void> {
    await this.#redis.set(this.#keys.id, randomUUID(), 'NX')
    const [id, last] = await Promise.all([this.#redis.get(this.#keys.id), this.#redis.get(this.#keys.seq)])
    const seq = Number(last ?? 0)
    if (id === this.#id && seq >= this.#cursor) return
    this.#id = id as string
    this.#cursor = seq
    this.#opts.onReset?.(this.#id)
  }

  #dispatch(event: LoggedEvent | SnapshotEvent): void {
    for (const fn of [...this.#listeners]) {
      try {
        fn(event)
      } catch (err) {
        this.#opts.onError?.(err)
      }
    }
  }

  #goneIds(now: number): Promise<string[]> {
    return this.#redis.zrangebyscore(this.#keys.gone, `(${now - this.#goneTtlMs}`, '+inf')
  }
}

function checkRetention(retention = 10_000): number {
  if (!(Number.isInteger(retention) && retention > 0)) throw new RangeError(`retention must be a positive integer, got ${retention}`)
  return retention
}

function seqOf(id: string): number {
  return Number(id.slice(0, id.indexOf('-')))
}

function field(entry: Entry, name: string): string | undefined {
  const f = entry[1]
  for (let i = 0; i < f.length; i += 2) if (f[i] === name) return f[i + 1]
  return undefined
}

function parse(entry: Entry): LoggedEvent {
  return { ...JSON.parse(field(entry, 'e') ?? '{}'), seq: seqOf(entry[0]) } as LoggedEvent
}
