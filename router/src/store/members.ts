import { hostname } from 'node:os'
import type { Redis } from 'ioredis'
import type { Clock } from '../../../common/clock.js'
import { type Every, every } from '../../../common/timers.js'
import { callEach, type StoreLogger } from './store-state.js'

/** What a router says about itself in `<prefix>routers:info` (for /topology). */
export interface MemberInfo {
  url?: string
  /** Wall ms. */
  startedAt: number
  pid: number
  host: string
}

export interface Member {
  routerId: string
  /** Until when its last renewal keeps it alive, ms on the Redis server's clock. */
  expiresAt: number
  /** Absent if its info entry is missing (being swept, or written by something else). */
  info?: MemberInfo
}

export type DepartedListener = (routerId: string, info: MemberInfo | undefined) => void

export interface MembershipOptions {
  redis: Redis
  routerId: string
  prefix?: string
  /** `store.memberTtlMs`: an entry not renewed for this long is departed; renewals every third of it. */
  ttlMs: number
  clock: Clock
  /** This router's URL for others to show; startedAt, pid and host are filled in. */
  url?: string
  logger?: StoreLogger
}

// KEYS: routers, info. ARGV: now (ms on the server's clock), the sweeper's own id. Removes every entry whose
// expiry is not after now, except the sweeper's own (its renewal is due, not its departure),
// and returns {id, info or false, ...} for each one this call removed: ZREM returning 1 makes
// the report, so of two sweepers each departure is reported by exactly one.
const SWEEP = `
local out = {}
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])) do
  if id ~= ARGV[2] and redis.call('ZREM', KEYS[1], id) == 1 then
    out[#out + 1] = id
    out[#out + 1] = redis.call('HGET', KEYS[2], id)
    redis.call('HDEL', KEYS[2], id)
  end
end
return out
`

// KEYS: routers, info. ARGV: ttl ms, id, info. Scores the entry by the Redis server's clock
// (TIME), never the caller's, and returns {added, the server's now in ms}.
const RENEW = `
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local added = redis.call('ZADD', KEYS[1], now + tonumber(ARGV[1]), ARGV[2])
redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
return {added, now}
`

/**
 * Router replicas on one Redis (issue 10). `<prefix>routers` is a sorted set of router ids
 * scored by when each entry expires: the Redis server's time at its last renewal plus ttlMs;
 * `<prefix>routers:info` maps each id to its `MemberInfo` as JSON. A router is alive while its
 * score is after now, on the server's clock too (issue 21 item 6): each renewal also tells
 * this router how far the server's clock is from its own monotonic one, so a host whose wall
 * clock is off by more than a TTL neither sees live routers departed nor keeps dead ones.
 *
 * `join()` announces this router and renews every ttlMs/3 until `leave()`. While Redis is
 * unreachable renewals fail quietly (one warning per outage) and resume when it is back. A
 * router that was away longer than its TTL simply re-joins with its next renewal; it may
 * already have been reported departed by then (its leases reclaimed and so on), which is
 * fine: departure is about what it held then, and it comes back as a new member.
 *
 * `sweep()`, called on the prober leader only, removes expired entries and reports each to
 * `onDeparted` listeners, on that one router, exactly once across all sweepers.
 */
export class Membership {
  readonly routerId: string
  readonly #redis: Redis
  readonly #clock: Clock
  readonly #opts: MembershipOptions
  readonly #keys: { routers: string; info: string }
  readonly #info: string
  readonly #listeners = new Set<DepartedListener>()
  #joined = false
  #renewals: Every | undefined
  #inflight: Promise<boolean> | undefined
  #failing = false
  /** Whether a renewal has ever reached Redis: a later one that adds the entry back is a re-join. */
  #wasMember = false
  /** The Redis server's clock minus this router's monotonic one, ms (from the last renewal). */
  #serverOffset: number | undefined

  constructor(opts: MembershipOptions) {
    if (!(Number.isInteger(opts.ttlMs) && opts.ttlMs >= 3)) throw new RangeError(`ttlMs must be an integer ≥ 3, got ${opts.ttlMs}`)
    if (!opts.routerId) throw new RangeError('routerId must not be empty')
    this.routerId = opts.routerId
    this.#opts = opts
    this.#redis = opts.redis
    this.#clock = opts.clock
    const prefix = opts.prefix ?? 'handoff:'
    this.#keys = { routers: `${prefix}routers`, info: `${prefix}routers:info` }
    const info: MemberInfo = { ...(opts.url !== undefined && { url: opts.url }), startedAt: opts.clock.now(), pid: process.pid, host: hostname() }
    this.#info = JSON.stringify(info)
  }

  get joined(): boolean {
    return this.#joined
  }

  /** Announces this router and keeps renewing; true if the first announcement reached Redis (renewals go on either way). */
  async join(): Promise<boolean> {
    if (this.#joined) return true
    this.#joined = true
    this.#renewals = every(this.#clock, Math.floor(this.#opts.ttlMs / 3), () => this.#renew().then(() => {}))
    return this.#renew()
  }

  /**
   * Stops renewing and removes this router's entries, so others see it gone at once rather
   * than after its TTL; false if Redis could not be told (the entry then just expires).
   */
  async leave(): Promise<boolean> {
    if (!this.#joined) return true
    this.#joined = false
    this.#renewals?.stop()
    this.#renewals = undefined
    await this.#inflight
    try {
      await this.#redis.multi().zrem(this.#keys.routers, this.routerId).hdel(this.#keys.info, this.routerId).exec()
      return true
    } catch (err) {
      this.#opts.logger?.warn({ err: message(err) }, 'could not remove this router from the shared store; its entry expires by itself')
      return false
    }
  }

  /** The ids whose entries are still alive (expiry after now). */
  async alive(): Promise<string[]> {
    return this.#redis.zrangebyscore(this.#keys.routers, `(${this.#now()}`, '+inf')
  }

  /** The alive routers with their expiry and info. */
  async members(): Promise<Member[]> {
    const raw = await this.#redis.zrangebyscore(this.#keys.routers, `(${this.#now()}`, '+inf', 'WITHSCORES')
    const ids = raw.filter((_, i) => i % 2 === 0)
    const infos = ids.length > 0 ? await this.#redis.hmget(this.#keys.info, ...ids) : []
    return ids.map((routerId, i) => {
      const info = parseInfo(infos[i] ?? null)
      return { routerId, expiresAt: Number(raw[2 * i + 1]), ...(info && { info }) }
    })
  }

  /** Called once per departed router, on the router whose `sweep()` removed it. */
  onDeparted(listener: DepartedListener): () => void {
    this.#listeners.add(listener)
    return () => {
      this.#listeners.delete(listener)
    }
  }

  /**
   * Removes the entries that expired (never this router's own) and tells the listeners;
   * returns the ids it removed. Throws if Redis is unreachable (the next sweep catches up).
   */
  async sweep(): Promise<string[]> {
    const out = (await this.#redis.eval(SWEEP, 2, this.#keys.routers, this.#keys.info, this.#now(), this.routerId)) as (string | null)[]
    const ids: string[] = []
    for (let i = 0; i < out.length; i += 2) {
      const id = out[i] as string
      const info = parseInfo(out[i + 1] ?? null)
      ids.push(id)
      this.#opts.logger?.info({ routerId: id }, 'router replica departed (its membership expired)')
      callEach(this.#listeners, [id, info], this.#opts.logger)
    }
    return ids
  }

  /** The Redis server's time now, ms: this router's monotonic clock and the last offset measured. */
  #now(): number {
    return this.#serverOffset === undefined ? this.#clock.now() : this.#clock.monotonic() + this.#serverOffset
  }

  #renew(): Promise<boolean> {
    const sent = this.#clock.monotonic()
    const attempt = (this.#redis.eval(RENEW, 2, this.#keys.routers, this.#keys.info, this.#opts.ttlMs, this.routerId, this.#info) as Promise<[number, number]>)
      .then(
        ([added, serverNow]) => {
          // The server read its clock somewhere between send and answer: take the middle.
          this.#serverOffset = Number(serverNow) - (sent + this.#clock.monotonic()) / 2
          if (this.#failing) this.#opts.logger?.info({}, 'membership renewals reach the shared store again')
          // Added back: a sweep took it while it was away past its TTL (see the class comment), or Redis restarted empty.
          if (added === 1 && this.#wasMember) this.#opts.logger?.info({}, 'this router re-joined: its entry had expired (swept) or Redis lost it')
          this.#failing = false
          this.#wasMember = true
          return true
        },
        (err: unknown) => {
          if (!this.#failing) this.#opts.logger?.warn({ err: message(err) }, 'cannot renew this router’s membership in the shared store; retrying')
          this.#failing = true
          return false
        },
      )
    this.#inflight = attempt
    return attempt
  }
}

function parseInfo(raw: string | null): MemberInfo | undefined {
  if (raw === null) return undefined
  try {
    return JSON.parse(raw) as MemberInfo
  } catch {
    return undefined
  }
}

function message(err: unknown): string {
  return err instanceof Error ? err.message : String(err)
}
