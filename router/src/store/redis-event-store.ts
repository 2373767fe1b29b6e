import { createHash, randomUUID } from 'node:crypto'
import type { Redis } from 'ioredis'
import type { PeerAliveEvent, PeerGoneEvent, RouterEvent, SnapshotEvent } from '../../../schemas/events.js'
import { engineIdsOf, type Delivery, type EventInput, type LoggedEvent, type LogStats, type PeerAliveInput, type PeerGoneInput } from '../events/event-log.js'
import { READER_BLOCK_MS, retryableRedisError } from './connection.js'
import type { EventListener, EventStore, EventStoreOptions } from './event-store.js'

/**
 * The event log in Redis (issue 10), shared by every router on it. Keys, under `prefix`
 * (default `handoff:`):
 * - `events`: a stream; entry id `<seq>-0`, fields `e` (the event as JSON, without seq) and
 *   `r` (the id of its roster, '' when it is for nobody). Trimmed to `retention` entries, and
 *   past `deliveryEntries` tracked agents (issue 18 item 3), oldest first.
 * - `events:seq`: the last sequence (INCR inside the append script, so sequence order is
 *   stream order whichever router appends).
 * - `events:id`: the log's id (SET NX at open: the first router names it, restarts keep it).
 *   Every append checks it in the same script, with the sequence against the highest this
 *   router knew logged: a missing id (FLUSHALL, keys lost) or a sequence behind it (Redis
 *   restarted from an older RDB, an AOF tail lost, a lagging replica promoted) means the
 *   history diverged. The log is then renamed (issue 21 items 2 and 3), agents start it over,
 *   and each router logs again what it logged and did not see delivered.
 * - `events:gone`: sorted set, engine_id scored by when it was declared gone (wall ms).
 * - `events:roster:<id>` (set) and `events:roster-list:<id>` (JSON, in the order given): the
 *   agents an event is for. The id is a hash of the list, so every event for the same agents
 *   (a peer_gone for all of them, again and again) shares one; `events:rosters` counts the
 *   held events per roster, and a roster goes with the last of them. `events:tracked` is the
 *   sum of the held rosters' sizes.
 * - `events:left`: hash, seq → expected agents that have not acknowledged it yet (the field
 *   goes once it is delivered or trimmed); `events:pending:<roster id>`: sorted set of those
 *   sequences by roster, so that an ack visits only the events still waiting for its agent,
 *   however far it jumps (issue 21 item 6).
 * - `acks`: hash, agent id → the last sequence it acknowledged; agents no held event is for
 *   are forgotten past `ackFloor`.
 * Entries logged before rosters (field `x`, sets `events:waiting:<seq>`) are still read and
 * acknowledged until they are trimmed.
 * Scripts name keys they derive (`roster:<id>`) through ARGV: fine on one Redis, not on a cluster.
 */
export interface RedisEventStoreOptions extends EventStoreOptions {
  /** Commands go through it; a duplicate does the blocking reads. The caller owns and closes it. */
  redis: Redis
  prefix?: string
  /** The live reader's failures (a Redis outage); it retries every `retryMs`. */
  onError?: (err: unknown) => void
  /**
   * The log turned out to be another one (Redis restarted empty, flushed, or rolled back):
   * `id` is the new log's, and every agent must start over (their streams should be ended).
   * Called before this router's undelivered events are logged again in it.
   */
  onReset?: (id: string, why: string) => void
  retryMs?: number
}

// KEYS: stream, seq, gone, rosters, tracked, left. ARGV: event JSON, roster JSON, retention,
// derived-key prefix, roster id, at, gone cutoff, n, deliveryEntries, n expected agents, then
// the engine_ids it declares gone.
const APPEND = `
local seq = redis.call('INCR', KEYS[2])
local n = tonumber(ARGV[8])
local rid = ARGV[5]
if n > 0 then
  if redis.call('HINCRBY', KEYS[4], rid, 1) == 1 then
    for i = 10, 9 + n, 1000 do redis.call('SADD', ARGV[4] .. 'roster:' .. rid, unpack(ARGV, i, math.min(i + 999, 9 + n))) end
    redis.call('SET', ARGV[4] .. 'roster-list:' .. rid, ARGV[2])
    redis.call('INCRBY', KEYS[5], n)
  end
  redis.call('HSET', KEYS[6], seq, n)
  redis.call('ZADD', ARGV[4] .. 'pending:' .. rid, seq, seq)
end
redis.call('XADD', KEYS[1], seq .. '-0', 'e', ARGV[1], 'r', rid)
local retention = tonumber(ARGV[3])
local cap = tonumber(ARGV[9])
local len = redis.call('XLEN', KEYS[1])
while len > retention or (len > 1 and tonumber(redis.call('GET', KEYS[5]) or '0') > cap) do
  local head = redis.call('XRANGE', KEYS[1], '-', '+', 'COUNT', 1)[1]
  local q = string.match(head[1], '^(%d+)')
  local r
  for i = 1, #head[2], 2 do if head[2][i] == 'r' then r = head[2][i + 1] end end
  redis.call('XDEL', KEYS[1], head[1])
  redis.call('HDEL', KEYS[6], q)
  redis.call('DEL', ARGV[4] .. 'waiting:' .. q)
  if r and r ~= '' then redis.call('ZREM', ARGV[4] .. 'pending:' .. r, q) end
  if r and r ~= '' and redis.call('HINCRBY', KEYS[4], r, -1) <= 0 then
    redis.call('HDEL', KEYS[4], r)
    redis.call('DECRBY', KEYS[5], redis.call('SCARD', ARGV[4] .. 'roster:' .. r))
    redis.call('DEL', ARGV[4] .. 'roster:' .. r, ARGV[4] .. 'roster-list:' .. r, ARGV[4] .. 'pending:' .. r)
  end
  len = len - 1
end
if #ARGV > 9 + n then
  for i = 10 + n, #ARGV do redis.call('ZADD', KEYS[3], ARGV[6], ARGV[i]) end
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', ARGV[7])
end
return seq
`

// The peer_gone and peer_alive appends: the event's JSON holds "engineIds":"${FRESH}", and
// `pick` (Lua) keeps in the table `ids` those of the engine_ids at the end of ARGV that the
// event should name, leaving ARGV's tail as the ones APPEND should mark gone. Logs nothing and
// returns {0} when none is kept, else {seq, the engine_ids logged}.
const FRESH = '@fresh@'
const appendNaming = (pick: string): string => `
local n = tonumber(ARGV[8])
local ids = {}
${pick}
if #ids == 0 then return {0} end
local i, j = string.find(ARGV[1], '"${FRESH}"', 1, true)
ARGV[1] = string.sub(ARGV[1], 1, i - 1) .. cjson.encode(ids) .. string.sub(ARGV[1], j + 1)
local seq = (function()
${APPEND}
end)()
return {seq, unpack(ids)}
`

// peer_gone: only the engine_ids not still gone (scored after the cutoff), which APPEND marks.
const APPEND_PEER_GONE = appendNaming(`
for i = 10 + n, #ARGV do
  local at = redis.call('ZSCORE', KEYS[3], ARGV[i])
  if not at or tonumber(at) <= tonumber(ARGV[7]) then ids[#ids + 1] = ARGV[i] end
end
for i = #ARGV, 10 + n, -1 do table.remove(ARGV, i) end
for _, id in ipairs(ids) do ARGV[#ARGV + 1] = id end
`)

// peer_alive: only the engine_ids still gone, which stop being gone (a later peer_gone logs
// again); APPEND marks none.
const APPEND_PEER_ALIVE = appendNaming(`
for i = 10 + n, #ARGV do
  local at = redis.call('ZSCORE', KEYS[3], ARGV[i])
  if at and tonumber(at) > tonumber(ARGV[7]) then ids[#ids + 1] = ARGV[i] end
end
for i = #ARGV, 10 + n, -1 do table.remove(ARGV, i) end
if #ids > 0 then redis.call('ZREM', KEYS[3], unpack(ids)) end
`)

// Prefixed to every append script (KEYS[7]: the id key; ARGV[1], ARGV[2]: the log id and the
// highest sequence this router knew logged, shifted off before the script proper): an append
// goes only into the log its router knows, never into one that replaced it or lost its tail.
const OTHER_LOG = 'HANDOFF_OTHER_LOG'
const guarded = (script: string): string => `
if redis.call('GET', KEYS[7]) ~= ARGV[1] or tonumber(redis.call('GET', KEYS[2]) or '0') < tonumber(ARGV[2]) then
  return redis.error_reply('${OTHER_LOG}')
end
table.remove(ARGV, 1)
table.remove(ARGV, 1)
${script}`

// KEYS: id, seq. ARGV: the id this router knows, the highest sequence it knew, a fresh id.
// Returns {id, seq}: the log as it stands, renamed when its id went (FLUSHALL) or its
// sequence fell behind (a rollback: the same id names another history from there on).
const RENEW = `
local id = redis.call('GET', KEYS[1])
local seq = tonumber(redis.call('GET', KEYS[2]) or '0')
if id == ARGV[1] and seq >= tonumber(ARGV[2]) then return {id, seq} end
if not id or id == ARGV[1] then
  id = ARGV[3]
  redis.call('SET', KEYS[1], id)
end
return {id, seq}
`

const GUARDED_APPEND = guarded(APPEND)
const GUARDED_PEER_GONE = guarded(APPEND_PEER_GONE)
const GUARDED_PEER_ALIVE = guarded(APPEND_PEER_ALIVE)

// KEYS: acks, seq, stream, left, rosters, tracked. ARGV: agent, seq, derived-key prefix,
// ackFloor. Returns [seq, event JSON, ...] for each event this ack completed (its last
// expected agent). Visits the held rosters that name the agent and, in each, only the events
// still waiting (events:pending:<roster>) in the range the ack newly covers: the cost follows
// the events that wait for this agent, never the width of the jump.
const ACK = `
local last = tonumber(redis.call('GET', KEYS[2]) or '0')
local s = tonumber(ARGV[2])
if s > last then return {} end
local before = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0')
if s <= before then return {} end
redis.call('HSET', KEYS[1], ARGV[1], s)
local function field(entry, name)
  for i = 1, #entry[2], 2 do if entry[2][i] == name then return entry[2][i + 1] end end
end
local done = {}
local function complete(q)
  local entry = redis.call('XRANGE', KEYS[3], q .. '-0', q .. '-0')[1]
  if entry then
    done[#done + 1] = q
    done[#done + 1] = field(entry, 'e')
  end
end
for _, r in ipairs(redis.call('HKEYS', KEYS[5])) do
  if redis.call('SISMEMBER', ARGV[3] .. 'roster:' .. r, ARGV[1]) == 1 then
    local pending = ARGV[3] .. 'pending:' .. r
    for _, q in ipairs(redis.call('ZRANGEBYSCORE', pending, '(' .. before, s)) do
      if redis.call('HINCRBY', KEYS[4], q, -1) <= 0 then
        redis.call('HDEL', KEYS[4], q)
        redis.call('ZREM', pending, q)
        complete(q)
      end
    end
  end
end
-- Entries logged before rosters (field x, sets waiting:<seq>) are the oldest: the head.
local cursor = '(' .. before .. '-0'
local count = 1
while true do
  local page = redis.call('XRANGE', KEYS[3], cursor, s .. '-0', 'COUNT', count)
  local legacy = 0
  for _, entry in ipairs(page) do
    if field(entry, 'r') ~= nil then break end
    legacy = legacy + 1
    local q = string.match(entry[1], '^(%d+)')
    local k = ARGV[3] .. 'waiting:' .. q
    if redis.call('SREM', k, ARGV[1]) == 1 and redis.call('EXISTS', k) == 0 then complete(q) end
    cursor = '(' .. entry[1]
  end
  if legacy < count then break end
  count = 100
end
local tracked = tonumber(redis.call('GET', KEYS[6]) or '0')
if redis.call('HLEN', KEYS[1]) > math.max(tonumber(ARGV[4]), 2 * tracked) then
  local keep = ARGV[3] .. 'acks-keep'
  redis.call('DEL', keep)
  local rids = redis.call('HKEYS', KEYS[5])
  for _, r in ipairs(rids) do redis.call('SUNIONSTORE', keep, keep, ARGV[3] .. 'roster:' .. r) end
  local agents = redis.call('HKEYS', KEYS[1])
  for i = 1, #agents, 1000 do
    local some = {unpack(agents, i, math.min(i + 999, #agents))}
    local member = redis.call('SMISMEMBER', keep, unpack(some))
    for j, a in ipairs(some) do if member[j] == 0 then redis.call('HDEL', KEYS[1], a) end end
  end
  redis.call('DEL', keep)
end
return done
`

type Entry = [id: string, fields: string[]]

/** An event this router logged, kept until delivered so that a log that lost it gets it again. */
type Logged =
  | { kind: 'append'; input: EventInput; expected: readonly string[]; at: number }
  | { kind: 'gone'; input: PeerGoneInput; expected: readonly string[]; at: number }
  | { kind: 'alive'; input: PeerAliveInput; expected: readonly string[]; at: number }

export class RedisEventStore implements EventStore {
  #id: string
  /** The highest sequence this router knows the log reached (its appends, its reader). */
  #high: number
  /** This router's events not yet seen delivered, by `<log id> <seq>`, oldest first. */
  readonly #mine = new Map<string, Logged>()
  #renewing: Promise<void> | undefined
  /** Whether #mine holds events of a log that is gone (set by a renewal, and by a replay that failed). */
  #toReplay = false
  readonly #redis: Redis
  readonly #reader: Redis
  readonly #opts: RedisEventStoreOptions
  readonly #retention: number
  readonly #goneTtlMs: number
  readonly #keys: { stream: string; seq: string; gone: string; derived: string; rosters: string; tracked: string; left: string; acks: string; id: string }
  readonly #deliveryEntries: number
  readonly #listeners = new Set<EventListener>()
  #cursor: number
  #closed = false
  #loop: Promise<void> | undefined

  /** Opens (or joins) the log: names it if nobody has, and starts the live reader after the last sequence. */
  static async open(opts: RedisEventStoreOptions): Promise<RedisEventStore> {
    const prefix = opts.prefix ?? 'handoff:'
    checkRetention(opts.retention)
    checkDeliveryEntries(opts.deliveryEntries)
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
    this.#high = cursor
    this.#deliveryEntries = checkDeliveryEntries(opts.deliveryEntries)
    this.#keys = {
      stream: `${prefix}events`,
      seq: `${prefix}events:seq`,
      gone: `${prefix}events:gone`,
      derived: `${prefix}events:`,
      rosters: `${prefix}events:rosters`,
      tracked: `${prefix}events:tracked`,
      left: `${prefix}events:left`,
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
    const [log, seq] = await this.#append(GUARDED_APPEND, body, expected, input.type === 'peer_gone' ? input.engineIds : [])
    this.#keep(log, seq as number, { kind: 'append', input, expected, at })
    return { ...body, seq } as LoggedEvent
  }

  async appendPeerGone(input: PeerGoneInput, expected: readonly string[]): Promise<PeerGoneEvent | undefined> {
    const at = this.#opts.clock.now()
    const [log, [seq, ...fresh]] = (await this.#append(GUARDED_PEER_GONE, { ...input, engineIds: FRESH, at }, expected, input.engineIds)) as [string, [number, ...string[]]]
    if (seq === 0) return undefined
    this.#keep(log, seq, { kind: 'gone', input: { ...input, engineIds: fresh }, expected, at })
    return { ...input, engineIds: fresh, at, seq }
  }

  async appendPeerAlive(input: PeerAliveInput, expected: readonly string[]): Promise<PeerAliveEvent | undefined> {
    const at = this.#opts.clock.now()
    const [log, [seq, ...alive]] = (await this.#append(GUARDED_PEER_ALIVE, { ...input, engineIds: FRESH, at }, expected, input.engineIds)) as [string, [number, ...string[]]]
    if (seq === 0) return undefined
    this.#keep(log, seq, { kind: 'alive', input: { ...input, engineIds: alive }, expected, at })
    return { ...input, engineIds: alive, at, seq }
  }

  /**
   * Runs a guarded append script; refused because the log is not the one this router knows,
   * it takes up the log as it stands (renamed if need be) and appends there. Returns the log
   * appended to and the script's answer.
   */
  async #append(script: string, body: { at: number } & Record<string, unknown>, expected: readonly string[], gone: readonly string[]): Promise<[string, unknown]> {
    for (let tries = 0; ; tries++) {
      const log = this.#id
      try {
        const answer = await this.#eval(script, log, body, expected, gone)
        const seq = Array.isArray(answer) ? Number(answer[0]) : Number(answer)
        if (log === this.#id) this.#high = Math.max(this.#high, seq)
        return [log, answer]
      } catch (err) {
        if (tries > 0 || !(err instanceof Error && err.message.includes(OTHER_LOG))) throw err
        await this.#renew('an append found another log')
      }
    }
  }

  /** An append script with the arguments they all take (see APPEND, guarded). */
  #eval(script: string, log: string, body: { at: number } & Record<string, unknown>, expected: readonly string[], gone: readonly string[]): Promise<unknown> {
    const { at } = body
    const k = this.#keys
    const agents = [...new Set(expected)]
    const roster = JSON.stringify(agents)
    return this.#redis.eval(
      script,
      7,
      k.stream,
      k.seq,
      k.gone,
      k.rosters,
      k.tracked,
      k.left,
      k.id,
      log,
      this.#high,
      JSON.stringify(body),
      roster,
      this.#retention,
      k.derived,
      agents.length > 0 ? createHash('sha1').update(roster).digest('hex') : '',
      at,
      at - this.#goneTtlMs,
      agents.length,
      this.#deliveryEntries,
      ...agents,
      ...gone,
    )
  }

  async since(after: number, limit = Infinity): Promise<RouterEvent[]> {
    const now = this.#opts.clock.now()
    const tx = this.#redis.multi().xrange(this.#keys.stream, '-', '+', 'COUNT', 1)
    if (Number.isFinite(limit)) tx.xrange(this.#keys.stream, `${after + 1}-0`, '+', 'COUNT', limit)
    else tx.xrange(this.#keys.stream, `${after + 1}-0`, '+')
    const [[, head], [, rest], [, last], [, gone]] = (await tx
      .get(this.#keys.seq)
      .zrangebyscore(this.#keys.gone, `(${now - this.#goneTtlMs}`, '+inf')
      .exec()) as [[null, Entry[]], [null, Entry[]], [null, string | null], [null, string[]]]
    const first = head[0] ? seqOf(head[0][0]) : Number(last ?? 0) + 1
    const out: RouterEvent[] = []
    if (after < first - 1) out.push({ seq: first - 1, type: 'snapshot', goneEngineIds: gone, at: now })
    for (const entry of rest) if (out.length < limit) out.push(parse(entry))
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
    const k = this.#keys
    const log = this.#id
    const done = (await this.#redis.eval(ACK, 6, k.acks, k.seq, k.stream, k.left, k.rosters, k.tracked, agentId, seq, k.derived, this.#opts.ackFloor ?? 1024)) as (number | string)[]
    for (let i = 0; i < done.length; i += 2) this.#mine.delete(`${log} ${done[i]}`)
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
    const expected = await this.#expected(entry)
    const acks = expected.length > 0 ? await this.#redis.hmget(this.#keys.acks, ...expected) : []
    return { seq, type: event.type, engineIds: engineIdsOf(event), expected, applied: expected.filter((_, i) => Number(acks[i] ?? 0) >= seq) }
  }

  async undelivered(agents: ReadonlySet<string>): Promise<number> {
    if (agents.size === 0) return 0
    const names = [...agents]
    const raw = await this.#redis.hmget(this.#keys.acks, ...names)
    const acks = new Map(names.map((a, i) => [a, Number(raw[i] ?? 0)] as const))
    // Only what lies after the slowest of them can still wait for one of them.
    const from = Math.min(...acks.values()) + 1
    const entries = (await this.#redis.xrange(this.#keys.stream, `${from}-0`, '+')) as Entry[]
    // Which of them each roster holds, asked once per roster.
    const rosters = new Map<string, string[]>()
    for (const entry of entries) {
      const r = field(entry, 'r')
      if (r && !rosters.has(r)) {
        const member = (await this.#redis.smismember(`${this.#keys.derived}roster:${r}`, ...names)) as number[]
        rosters.set(
          r,
          names.filter((_, i) => member[i] === 1),
        )
      }
    }
    let n = 0
    for (const entry of entries) {
      const seq = seqOf(entry[0])
      const r = field(entry, 'r')
      const expected = r !== undefined ? (rosters.get(r) ?? []) : (JSON.parse(field(entry, 'x') ?? '[]') as string[])
      if (expected.some((a) => (acks.get(a) ?? seq) < seq)) n++
    }
    return n
  }

  async stats(): Promise<LogStats> {
    const [[, events], [, tracked], [, acks]] = (await this.#redis.multi().xlen(this.#keys.stream).get(this.#keys.tracked).hlen(this.#keys.acks).exec()) as [[null, number], [null, string | null], [null, number]]
    return { events, tracked: Number(tracked ?? 0), acks }
  }

  /** The agents an entry is for: its roster's list (or, logged before rosters, its own). */
  async #expected(entry: Entry): Promise<string[]> {
    const r = field(entry, 'r')
    if (r === undefined) return JSON.parse(field(entry, 'x') ?? '[]') as string[]
    if (r === '') return []
    return JSON.parse((await this.#redis.get(`${this.#keys.derived}roster-list:${r}`)) ?? '[]') as string[]
  }

  retryable(err: unknown): boolean {
    // The log changed again while this router took up the last change: the next try goes on.
    return retryableRedisError(err) || (err instanceof Error && err.message.includes(OTHER_LOG))
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
        // Back after an outage, or a round with nothing new (a log flushed or rolled back
        // under this reader leaves it waiting past an end that no longer exists): still the
        // log this router knows?
        if (failed) await this.#renew('Redis answers again after an outage')
        const log = this.#id
        res = (await this.#reader.xread('COUNT', 500, 'BLOCK', READER_BLOCK_MS, 'STREAMS', this.#keys.stream, `${this.#cursor}-0`)) as [string, Entry[]][] | null
        failed = false
        // An append took up another log meanwhile: this read was after the old log's cursor.
        if (log !== this.#id) continue
        if (!res) await this.#renew('a read round found nothing new')
      } catch (err) {
        if (this.#closed) return
        // The first failure of a run is reported; the retries every retryMs are not.
        if (!failed) this.#opts.onError?.(err)
        failed = true
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
        this.#high = Math.max(this.#high, seq)
        this.#dispatch(parse(entry))
      }
    }
  }

  /**
   * Is the log still the one this router knows (its id, and a sequence not behind what it
   * saw)? If not, takes it up as it stands, renamed when its id went or its history fell
   * behind (see RENEW): the reader goes on from its end, the caller ends the agents' streams
   * (they start the new log over), and this router's undelivered events are logged again.
   * One at a time; a call during one waits for it.
   */
  #renew(why: string): Promise<void> {
    this.#renewing ??= (async () => {
      try {
        const k = this.#keys
        const old = this.#id
        const [id, seq] = (await this.#redis.eval(RENEW, 2, k.id, k.seq, old, this.#high, randomUUID())) as [string, number]
        if (id === old) return
        this.#id = id
        this.#cursor = Number(seq)
        this.#high = Number(seq)
        this.#toReplay = true
        this.#opts.onReset?.(id, why)
      } finally {
        this.#renewing = undefined
      }
    })()
    return this.#renewing.then(() => this.#replay())
  }

  /** Logs again, in order, this router's undelivered events of logs that are gone. */
  async #replay(): Promise<void> {
    // The reader renews every quiet second: the scan of #mine only after the log changed.
    if (!this.#toReplay) return
    this.#toReplay = false
    const stale = [...this.#mine].filter(([key]) => !key.startsWith(`${this.#id} `))
    for (const [key, e] of stale) {
      if (!this.#mine.delete(key)) continue // a concurrent replay took it
      try {
        if (e.kind === 'append') await this.append(e.input, e.expected)
        else if (e.kind === 'gone') await this.appendPeerGone(e.input, e.expected)
        else await this.appendPeerAlive(e.input, e.expected)
      } catch (err) {
        // Again at the next renewal, first: it came before every event still kept (the stale
        // ones after it, and whatever this log took since). Put back at the end, a peer_alive
        // would be logged before its peer_gone and leave a live engine tombstoned.
        const after = [...this.#mine]
        this.#mine.clear()
        this.#mine.set(key, e)
        for (const [k, v] of after) this.#mine.set(k, v)
        this.#toReplay = true
        throw err
      }
    }
  }

  /** Keeps what this router logged until it is seen delivered, within retention and goneTtlMs. */
  #keep(log: string, seq: number, e: Logged): void {
    this.#mine.set(`${log} ${seq}`, e)
    const oldest = this.#opts.clock.now() - this.#goneTtlMs
    for (const [key, kept] of this.#mine) {
      if (this.#mine.size <= this.#retention && kept.at >= oldest) break
      this.#mine.delete(key)
    }
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

function checkDeliveryEntries(n = 1 << 20): number {
  if (!(Number.isInteger(n) && n > 0)) throw new RangeError(`deliveryEntries must be a positive integer, got ${n}`)
  return n
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
