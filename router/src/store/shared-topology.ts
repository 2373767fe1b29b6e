import type { Redis } from 'ioredis'
import type { Clock, ClockTimer } from '../../../common/clock.js'
import type { InstanceConfig } from '../../../schemas/router-config.js'
import type { AgentDirectory, AgentRecord } from '../events/agent-directory.js'
import type { StreamPresence } from '../events/router-events.js'
import type { RemoteInflight } from '../topology/drainer.js'
import type { TopologyChange, TopologyRegistry } from '../topology/registry.js'
import type { InstanceSource } from '../topology/views.js'
import { READER_BLOCK_MS } from './connection.js'
import type { LeaderLock } from './leader.js'

/**
 * The topology several routers share through Redis (issue 10, DESIGN "State store"). Each
 * router keeps its own registry and agent directory — the request path reads memory, never
 * Redis — and this keeps them in step: what changes here is written to Redis, what another
 * router wrote is applied here. When Redis is unreachable the router goes on with what it
 * has (the last topology it saw); when it is back, `resync()` writes what changed here
 * meanwhile and reads everything again.
 *
 * Keys, under the prefix:
 * - `instances`: hash, instance id → its record (config, origin, engine_ids, draining), or a
 *   tombstone `{removed: true}` so a router that missed the removal does not bring it back.
 *   `engineIds` is the set, least recently seen first, with `sharedRanks` when the URL proved
 *   to front several engines per rank; `engineId`, the newest, is what routers from before
 *   sets read;
 * - `health`: hash, instance id → the prober leader's verdict `{up, models}` (written only
 *   while the writer still leads: LeaderLock.fenced checks its term in the same script);
 * - `agents`: hash, agent id → its record, or a tombstone;
 * - `agents:streams`: hash, agent id → the router holding its event stream;
 * - `inflight:<instance>`: hash, router id → its requests in flight there (draining ones only;
 *   a live router with no entry has not heard of the drain yet);
 * - `topology`: a stream of change notices `{t: table, k: key, r: router}`; each router tails
 *   it and reloads the keys other routers changed.
 */
export interface SharedTopologyOptions {
  /** The command connection; the caller owns it. A duplicate does the blocking reads. */
  redis: Redis
  prefix: string
  routerId: string
  registry: TopologyRegistry
  agents: AgentDirectory
  clock: Clock
  /** Routers alive now (the membership); streams and counts of the others are ignored. */
  routers: { alive(): Promise<readonly string[]> }
  /** The prober leader lock: verdicts are shared only in a script fenced by this router's term. */
  leader: Pick<LeaderLock, 'isLeader' | 'fenced'>
  logger: { info(obj: object, msg: string): void; warn(obj: object, msg: string): void }
  /** Tombstones are dropped after this long, ms (default 1 h). */
  tombstoneTtlMs?: number
  /** Notices kept in the change stream (approximate; default 10,000). */
  noticeRetention?: number
  retryMs?: number
  /**
   * Awaited before this router publishes what it has in flight at a draining instance: the
   * lease ledger's mirror write (RedisLeaseLedger.flush). A prefill leg's lease is issued
   * before its slot goes back, and a drain on another router reads the counts before the
   * leases, so the lease must be in Redis before the count that no longer holds the leg.
   * False: they could not be written, and the older (higher) count stands until the next
   * change or resync.
   */
  beforeInflight?: () => Promise<boolean>
}

/** Each router's count of a draining instance outlives its last change by this much at most (a backstop: a drain ends by removing the hash). */
const INFLIGHT_TTL_MS = 3600_000

interface InstanceRecord {
  id: string
  role?: InstanceConfig['role']
  url?: string
  labels?: Record<string, string>
  kvEvents?: InstanceConfig['kvEvents']
  source?: InstanceSource
  /** The newest of engineIds (routers from before the set read only this). */
  engineId?: string
  engineIds?: string[]
  sharedRanks?: true
  draining?: boolean
  removed?: true
  at: number
}

type AgentRow = (Omit<AgentRecord, 'streams'> & { removed?: undefined; at: number }) | { agentId: string; removed: true; at: number }

interface HealthRecord {
  up: boolean
  models?: string[]
  at: number
}

type Table = 'instances' | 'health' | 'agents'

// Run through LeaderLock.fenced. KEYS: health hash, notice stream. ARGV: id, record, router, retention.
const PUT_HEALTH = `
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[4], '*', 't', 'health', 'k', ARGV[1], 'r', ARGV[3])
return 1
`

// KEYS: streams hash. ARGV: agent, router. Deletes the entry only while it names this router.
const RELEASE_STREAM = `
if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then return redis.call('HDEL', KEYS[1], ARGV[1]) end
return 0
`

type Entry = [id: string, fields: string[]]

export class SharedTopology implements StreamPresence {
  readonly #o: SharedTopologyOptions
  readonly #reader: Redis
  readonly #keys: Record<Table | 'streams' | 'notices', string>
  readonly #unsubscribe: (() => void)[] = []
  /** Keys whose write failed (Redis away): this router's version goes first at the next resync. */
  readonly #dirty = new Set<string>()
  #applying = false
  #cursor = '0-0'
  #closed = false
  #loop: Promise<void> | undefined
  #synced = false
  #refresh: ClockTimer | undefined

  constructor(opts: SharedTopologyOptions) {
    this.#o = opts
    const p = opts.prefix
    this.#keys = { instances: `${p}instances`, health: `${p}health`, agents: `${p}agents`, streams: `${p}agents:streams`, notices: `${p}topology` }
    this.#reader = opts.redis.duplicate()
    this.#reader.on('error', () => {}) // the read loop reports and retries
  }

  /** Whether a full read of Redis has succeeded (the topology here includes the other routers'). */
  get synced(): boolean {
    return this.#synced
  }

  /**
   * Joins: reads what the other routers wrote, then follows their changes and shares this
   * router's. With Redis unreachable it starts from the config alone and syncs once it can.
   */
  async start(): Promise<void> {
    this.#unsubscribe.push(
      this.#o.registry.subscribe((change) => {
        if (!this.#applying) this.#onLocal(change)
      }),
      this.#o.agents.subscribe((agentId, record) => {
        if (this.#applying) return
        const row: AgentRow = record ? { ...withoutStreams(record), at: this.#o.clock.now() } : { agentId, removed: true, at: this.#o.clock.now() }
        void this.#put('agents', agentId, row)
      }),
    )
    try {
      await this.resync()
    } catch (err) {
      this.#o.logger.warn({ err: (err as Error).message }, 'shared topology: Redis unreachable at start; routing from the config until it answers')
    }
    this.#loop = this.#follow()
    // The other routers trust an agent's reads only while its record says it was connected
    // lately (AgentDirectory.checksReads): the streams held here are written again well within that.
    const every = Math.max(100, this.#o.agents.trustMs / 3)
    const refresh = (): void => {
      if (this.#closed) return
      this.#o.agents.refreshConnected()
      this.#refresh = this.#o.clock.setTimeout(refresh, every)
      this.#refresh.unref?.()
    }
    this.#refresh = this.#o.clock.setTimeout(refresh, every)
    this.#refresh.unref?.()
  }

  /**
   * Writes what failed to be written (this router's newer knowledge), then reads the whole
   * shared topology and applies it. Called at start and whenever Redis is back.
   */
  async resync(): Promise<void> {
    const { redis } = this.#o
    const [last] = (await redis.xrevrange(this.#keys.notices, '+', '-', 'COUNT', 1)) as Entry[]
    // Notices after this point are read by the follower; nothing between is missed.
    const cursor = last?.[0] ?? '0-0'
    for (const key of [...this.#dirty]) {
      const [table, id] = splitKey(key)
      const row = table === 'instances' ? this.#instanceRow(id) : table === 'agents' ? this.#agentRow(id) : this.#healthRow(id)
      if (row) await this.#put(table, id, row)
      this.#dirty.delete(key)
    }
    const [instances, health, agents] = await Promise.all([redis.hgetall(this.#keys.instances), redis.hgetall(this.#keys.health), redis.hgetall(this.#keys.agents)])
    this.#cursor = cursor
    const now = this.#o.clock.now()
    const ttl = this.#o.tombstoneTtlMs ?? 3600_000
    this.#apply(() => {
      for (const raw of Object.values(instances)) this.#applyInstance(JSON.parse(raw) as InstanceRecord)
      for (const [id, raw] of Object.entries(health)) this.#applyHealth(id, JSON.parse(raw) as HealthRecord)
      for (const raw of Object.values(agents)) this.#applyAgent(JSON.parse(raw) as AgentRow)
    })
    // What this router has and Redis lacks (Redis restarted empty, or a write lost): share it.
    for (const id of this.#o.registry.ids()) {
      const described = this.#o.registry.describe(id)
      if (!(id in instances) && described && (described.source !== 'config' || described.engineId || described.draining)) await this.#put('instances', id, this.#instanceRow(id) as InstanceRecord, true)
    }
    for (const a of this.#o.agents.all()) if (!(a.agentId in agents)) await this.#put('agents', a.agentId, { ...withoutStreams(a), at: now }, true)
    // Counts at draining instances that could not be published meanwhile.
    for (const id of this.#o.registry.ids()) if (this.#o.registry.describe(id)?.draining) this.#publishInflight(id)
    // Old tombstones go (any router may do it; HDEL of a field already gone is harmless).
    const stale = [
      ...Object.entries(instances).filter(([, raw]) => isOldTombstone(raw, now, ttl)),
      ...Object.entries(agents).filter(([, raw]) => isOldTombstone(raw, now, ttl)),
    ]
    if (stale.length > 0) {
      await redis
        .multi()
        .hdel(this.#keys.instances, ...stale.map(([k]) => k))
        .hdel(this.#keys.agents, ...stale.map(([k]) => k))
        .exec()
    }
    this.#synced = true
  }

  // StreamPresence, with the streams of every router.
  opened(agentId: string): void {
    this.#o.redis.hset(this.#keys.streams, agentId, this.#o.routerId).catch(() => {})
  }

  closed(agentId: string): void {
    this.#o.redis.eval(RELEASE_STREAM, 1, this.#keys.streams, agentId, this.#o.routerId).catch(() => {})
  }

  async anyOpen(agentIds: readonly string[]): Promise<boolean> {
    if (agentIds.some((id) => (this.#o.agents.get(id)?.streams ?? 0) > 0)) return true
    if (agentIds.length === 0) return false
    const [holders, alive] = await Promise.all([this.#o.redis.hmget(this.#keys.streams, ...agentIds), this.#o.routers.alive()])
    const live = new Set(alive)
    return holders.some((r) => r !== null && r !== this.#o.routerId && live.has(r))
  }

  /**
   * Shares every verdict this router holds (a new prober leader after its first round): the
   * others may hold ones from before an outage, and verdicts are otherwise shared only when
   * they change.
   */
  publishVerdicts(): void {
    for (const id of this.#o.registry.ids()) {
      const row = this.#healthRow(id)
      if (row) this.#putHealth(id, row)
    }
  }

  /**
   * Requests in flight at `instanceId` on the other live routers (published while it drains),
   * and how many of them have published nothing yet: they have not heard of the drain, and
   * may have a leg there that nobody counts.
   */
  async remoteInflight(instanceId: string): Promise<RemoteInflight> {
    const [counts, alive] = await Promise.all([this.#o.redis.hgetall(`${this.#o.prefix}inflight:${instanceId}`), this.#o.routers.alive()])
    let inflight = 0
    let unheard = 0
    for (const router of alive) {
      if (router === this.#o.routerId) continue
      const count = counts[router]
      if (count === undefined) unheard++
      else inflight += Number(count)
    }
    return { inflight, unheard }
  }

  async close(): Promise<void> {
    if (this.#closed) return
    this.#closed = true
    if (this.#refresh) this.#o.clock.clearTimeout(this.#refresh)
    for (const u of this.#unsubscribe) u()
    this.#reader.disconnect()
    await this.#loop
  }

  #onLocal(change: TopologyChange): void {
    const id = change.instanceId
    switch (change.type) {
      case 'added':
      case 'draining':
      case 'engine_id_learned':
      case 'engine_id_changed': {
        const row = this.#instanceRow(id)
        if (row && (change.type !== 'added' || row.source !== 'config')) void this.#put('instances', id, row)
        if (change.type === 'draining') this.#publishInflight(id)
        return
      }
      case 'removed':
        void this.#put('instances', id, { id, removed: true, at: this.#o.clock.now() })
        this.#o.redis.multi().hdel(this.#keys.health, id).del(`${this.#o.prefix}inflight:${id}`).exec().catch(() => {})
        return
      case 'up':
      case 'down': {
        const row = this.#healthRow(id)
        if (row) this.#putHealth(id, row)
        return
      }
      case 'released':
      case 'drained':
        if (this.#o.registry.describe(id)?.draining) this.#publishInflight(id)
        return
    }
  }

  /** Publishes this router's count at a draining instance, once its leases are in Redis (beforeInflight); the count is read when it is sent. */
  #publishInflight(id: string): void {
    const publish = (): void => {
      if (this.#closed || !this.#o.registry.describe(id)?.draining) return
      const inflight = this.#o.registry.load(id)?.inflight ?? 0
      const key = `${this.#o.prefix}inflight:${id}`
      this.#o.redis.multi().hset(key, this.#o.routerId, inflight).pexpire(key, INFLIGHT_TTL_MS).exec().catch(() => {})
    }
    if (!this.#o.beforeInflight) return publish()
    this.#o.beforeInflight().then((written) => written && publish(), () => {})
  }

  #instanceRow(id: string): InstanceRecord | undefined {
    const d = this.#o.registry.describe(id)
    if (!d) return undefined
    const engines = d.engineId ? { engineId: d.engineId, engineIds: d.engineIds, ...(d.sharedRanks ? { sharedRanks: true as const } : {}) } : {}
    return { id, role: d.role, url: d.url, labels: d.labels ?? {}, ...(d.kvEvents ? { kvEvents: d.kvEvents } : {}), source: d.source, ...engines, draining: d.draining, at: this.#o.clock.now() }
  }

  #agentRow(agentId: string): AgentRow {
    const a = this.#o.agents.get(agentId)
    return a ? { ...withoutStreams(a), at: this.#o.clock.now() } : { agentId, removed: true, at: this.#o.clock.now() }
  }

  #healthRow(id: string): HealthRecord | undefined {
    const v = this.#o.registry.verdict(id)
    if (!v || v.up === undefined) return undefined
    return { up: v.up, ...(v.models ? { models: [...v.models] } : {}), at: this.#o.clock.now() }
  }

  /** Writes a record and its notice; `ifAbsent`: only where Redis has none (a republish must not overwrite newer news). */
  async #put(table: Table, id: string, row: object, ifAbsent = false): Promise<void> {
    try {
      const tx = this.#o.redis.multi()
      if (ifAbsent) tx.hsetnx(this.#keys[table], id, JSON.stringify(row))
      else tx.hset(this.#keys[table], id, JSON.stringify(row))
      await tx
        .xadd(this.#keys.notices, 'MAXLEN', '~', this.#o.noticeRetention ?? 10_000, '*', 't', table, 'k', id, 'r', this.#o.routerId)
        .exec()
      this.#dirty.delete(`${table}\u0000${id}`)
    } catch {
      this.#dirty.add(`${table}\u0000${id}`)
    }
  }

  /** Only the prober leader's verdicts are shared, and only while it still leads. */
  #putHealth(id: string, row: HealthRecord): void {
    if (!this.#o.leader.isLeader) return
    this.#o.leader.fenced([this.#keys.health, this.#keys.notices], [id, JSON.stringify(row), this.#o.routerId, this.#o.noticeRetention ?? 10_000], PUT_HEALTH).catch(() => {})
  }

  /** Tails the change stream; after a failure, a full resync (notices may have been missed). */
  async #follow(): Promise<void> {
    let failed = !this.#synced
    while (!this.#closed) {
      try {
        if (failed) {
          await this.resync()
          failed = false
          this.#o.logger.info({}, 'shared topology: in step with Redis again')
        }
        const res = (await this.#reader.xread('COUNT', 500, 'BLOCK', READER_BLOCK_MS, 'STREAMS', this.#keys.notices, this.#cursor)) as [string, Entry[]][] | null
        const notices = res?.[0]?.[1] ?? []
        if (notices.length === 0) continue
        this.#cursor = (notices.at(-1) as Entry)[0]
        await this.#reload(notices.map((e) => fields(e)).filter((n) => n.r !== this.#o.routerId))
      } catch (err) {
        if (this.#closed) return
        if (!failed) this.#o.logger.warn({ err: (err as Error).message }, 'shared topology: lost Redis; routing from the last topology')
        failed = true
        await new Promise((resolve) => setTimeout(resolve, this.#o.retryMs ?? 500))
      }
    }
  }

  async #reload(notices: { t: string; k: string }[]): Promise<void> {
    const byTable = new Map<Table, Set<string>>()
    for (const n of notices) {
      if (n.t !== 'instances' && n.t !== 'health' && n.t !== 'agents') continue
      const set = byTable.get(n.t) ?? new Set()
      set.add(n.k)
      byTable.set(n.t, set)
    }
    for (const table of ['instances', 'agents', 'health'] as const) {
      const keys = [...(byTable.get(table) ?? [])]
      if (keys.length === 0) continue
      const rows = await this.#o.redis.hmget(this.#keys[table], ...keys)
      this.#apply(() => {
        keys.forEach((k, i) => {
          const raw = rows[i]
          if (raw === null || raw === undefined) return
          if (table === 'instances') this.#applyInstance(JSON.parse(raw) as InstanceRecord)
          else if (table === 'agents') this.#applyAgent(JSON.parse(raw) as AgentRow)
          else this.#applyHealth(k, JSON.parse(raw) as HealthRecord)
        })
      })
    }
  }

  #apply(fn: () => void): void {
    this.#applying = true
    try {
      fn()
    } finally {
      this.#applying = false
    }
  }

  #applyInstance(r: InstanceRecord): void {
    const { registry } = this.#o
    if (this.#dirty.has(`instances\u0000${r.id}`)) return // this router's version is newer
    if (r.removed) {
      registry.remove(r.id)
      return
    }
    if (!registry.has(r.id)) {
      if (!r.role || !r.url) return
      // kvEvents too: every router follows every engine's KV events (docs/routing.md).
      registry.add({ id: r.id, role: r.role, url: r.url, ...(r.labels ? { labels: r.labels } : {}), ...(r.kvEvents ? { kvEvents: r.kvEvents } : {}) }, r.source ?? 'admin')
    }
    if (r.draining && !registry.describe(r.id)?.draining) {
      registry.drain(r.id)
      // The router draining it counts this one's requests there too.
      this.#publishInflight(r.id)
    }
    // Another router's set joins this one's: what it replaced is replaced here too (a repeat
    // peer_gone is a no-op); a URL it found shared first, so that nothing is replaced by it.
    if (r.sharedRanks) registry.markSharedRanks(r.id)
    for (const engineId of r.engineIds ?? (r.engineId ? [r.engineId] : [])) registry.observeEngineId(r.id, engineId)
  }

  #applyHealth(id: string, h: HealthRecord): void {
    // The leader's own verdicts are already here.
    if (this.#o.leader.isLeader) return
    this.#o.registry.applyVerdict(id, h.up, h.models)
  }

  #applyAgent(row: AgentRow): void {
    if (this.#dirty.has(`agents\u0000${row.agentId}`)) return
    if (row.removed) {
      this.#o.agents.remove(row.agentId)
      return
    }
    const { at: _at, ...record } = row
    this.#o.agents.put(record)
  }
}

function withoutStreams(a: AgentRecord): Omit<AgentRecord, 'streams'> {
  const { streams: _streams, ...rest } = a
  return rest
}

function splitKey(key: string): [Table, string] {
  const i = key.indexOf('\u0000')
  return [key.slice(0, i) as Table, key.slice(i + 1)]
}

function fields(entry: Entry): { t: string; k: string; r: string } {
  const f = entry[1]
  const out: Record<string, string> = {}
  for (let i = 0; i < f.length; i += 2) out[f[i] as string] = f[i + 1] as string
  return { t: out.t ?? '', k: out.k ?? '', r: out.r ?? '' }
}

function isOldTombstone(raw: string, now: number, ttl: number): boolean {
  const r = JSON.parse(raw) as { removed?: boolean; at?: number }
  return r.removed === true && (r.at ?? 0) < now - ttl
}
