import type { Redis } from 'ioredis'
import type { Clock, ClockTimer } from '../../../common/clock.js'
import { type Every, every } from '../../../common/timers.js'
import { callEach, type StoreLogger } from './store-state.js'

/**
 * Who runs the leader-only work (the prober) among routers. Leadership starts false;
 * `start()` resolves once the first attempt to lead is settled; listeners hear every change
 * after that, including the one `start()` makes.
 */
export interface Leadership {
  readonly isLeader: boolean
  /** The fencing token of the current term; undefined when not leading. */
  readonly token: number | undefined
  onChange(listener: LeadershipListener): () => void
  start(): Promise<void>
  stop(): Promise<void>
}

export type LeadershipListener = (isLeader: boolean, token: number | undefined) => void

/** The in-memory store's leadership: the one router leads from `start()` to `stop()`, token 1. */
export function soleLeader(): Leadership {
  const listeners = new Set<LeadershipListener>()
  let leading = false
  const set = (value: boolean): void => {
    if (leading === value) return
    leading = value
    for (const fn of [...listeners]) fn(value, value ? 1 : undefined)
  }
  return {
    get isLeader() {
      return leading
    },
    get token() {
      return leading ? 1 : undefined
    },
    onChange(listener) {
      listeners.add(listener)
      return () => {
        listeners.delete(listener)
      }
    },
    async start() {
      set(true)
    },
    async stop() {
      set(false)
    },
  }
}

export interface LeaderLockOptions {
  redis: Redis
  routerId: string
  prefix?: string
  /** The lock's PX, ms (`store.memberTtlMs`); renewals and follower attempts run every third of it. */
  ttlMs: number
  clock: Clock
  logger?: StoreLogger
}

/** What `fenced` did: the script's result, or nothing because another router (or nobody) holds the lock. */
export type FencedResult<T> = { applied: true; result: T } | { applied: false; holder: string | null }

// KEYS: leader, fence. ARGV: routerId, ttl ms, the value this router held last ('' if none),
// the highest token it has seen. Returns {token, value}, or {0, holder} when another holds it.
// Re-taking its own value is allowed (a renewal lost in flight). The floor keeps tokens rising
// after Redis lost the fence counter (restarted empty), as far as this router has seen.
const ACQUIRE = `
local cur = redis.call('GET', KEYS[1])
if cur and cur ~= ARGV[3] then return {0, cur} end
local token = redis.call('INCR', KEYS[2])
local floor = tonumber(ARGV[4])
if token <= floor then
  token = floor + 1
  redis.call('SET', KEYS[2], token)
end
local value = ARGV[1] .. ':' .. token
redis.call('SET', KEYS[1], value, 'PX', ARGV[2])
return {token, value}
`

// KEYS: leader. ARGV: value, ttl ms. 1 if still ours (and extended), else 0.
const RENEW = `
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
`

// KEYS: leader. ARGV: value. Deletes it only if it is still ours.
const RELEASE = `
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
`

const FENCED_MARK = 'HANDOFF_FENCED'

/**
 * The prober leader's lock (issue 10): `<prefix>leader` holds `<routerId>:<token>` with a PX
 * of `ttlMs`; the token comes from INCR `<prefix>leader:fence` at each acquisition, so a
 * later term always has a higher one. The leader renews every ttl/3 (compare-and-PEXPIRE)
 * and stops leading at once when a renewal finds another value or none; followers try to
 * acquire every ttl/3 (SET only if absent).
 *
 * While Redis is unreachable nobody can acquire, and a leader keeps leading only until `ttlMs`
 * (monotonic) after it *sent* its last successful renewal: its key cannot outlive that, so two
 * routers never both believe they lead, clock drift aside. Writes that must not come from a
 * former leader go through `fenced`, which Redis applies only while the key holds this term's
 * exact value: a leader paused past its term (SIGSTOP, a long GC) cannot write when it wakes.
 */
export class LeaderLock implements Leadership {
  readonly #redis: Redis
  readonly #clock: Clock
  readonly #opts: LeaderLockOptions
  readonly #keys: { leader: string; fence: string }
  readonly #intervalMs: number
  readonly #listeners = new Set<LeadershipListener>()
  #value: string | undefined
  /** The value of this router's latest term, ended or not: it may re-take that key, and stop() releases it. */
  #last: string | undefined
  #token: number | undefined
  /** Monotonic ms after which this term is over unless renewed. */
  #deadline = 0
  #maxToken = 0
  #started = false
  #attempts: Every | undefined
  #expiry: ClockTimer | undefined
  #inflight: Promise<void> | undefined
  #failing = false

  constructor(opts: LeaderLockOptions) {
    if (!(Number.isInteger(opts.ttlMs) && opts.ttlMs >= 3)) throw new RangeError(`ttlMs must be an integer ≥ 3, got ${opts.ttlMs}`)
    if (!opts.routerId) throw new RangeError('routerId must not be empty')
    this.#opts = opts
    this.#redis = opts.redis
    this.#clock = opts.clock
    this.#intervalMs = Math.floor(opts.ttlMs / 3)
    const prefix = opts.prefix ?? 'handoff:'
    this.#keys = { leader: `${prefix}leader`, fence: `${prefix}leader:fence` }
  }

  get isLeader(): boolean {
    return this.#value !== undefined && this.#clock.monotonic() < this.#deadline
  }

  get token(): number | undefined {
    return this.isLeader ? this.#token : undefined
  }

  onChange(listener: LeadershipListener): () => void {
    this.#listeners.add(listener)
    return () => {
      this.#listeners.delete(listener)
    }
  }

  /** Starts contending; resolves when the first attempt is settled (led or not). */
  async start(): Promise<void> {
    if (this.#started) return
    this.#started = true
    await this.#run()
    if (this.#started) this.#attempts = every(this.#clock, this.#intervalMs, () => this.#run())
  }

  /** Stops contending and, if leading, deletes the key (only if still ours) so another takes over at once. */
  async stop(): Promise<void> {
    if (!this.#started) return
    this.#started = false
    this.#attempts?.stop()
    this.#attempts = undefined
    await this.#inflight
    this.#stepDown()
    const value = this.#last
    this.#last = undefined
    if (value === undefined) return
    try {
      await this.#redis.eval(RELEASE, 1, this.#keys.leader, value)
    } catch (err) {
      // Unreachable: the key expires by itself within ttlMs.
      this.#opts.logger?.warn({ err: String(err) }, 'could not release the prober leader lock; it expires by itself')
    }
  }

  /**
   * Runs `script` (EVAL; its own KEYS and ARGV as given) only if this router still leads this
   * exact term, checked inside Redis in the same script. When not leading, nothing is sent.
   * A refusal ends this router's term at once.
   */
  async fenced<T = unknown>(keys: readonly string[], args: readonly (string | number)[], script: string): Promise<FencedResult<T>> {
    const value = this.#value
    if (value === undefined || !this.isLeader) return { applied: false, holder: null }
    try {
      const result = (await this.#redis.eval(fence(script), keys.length + 1, this.#keys.leader, ...keys, value, ...args)) as T
      return { applied: true, result }
    } catch (err) {
      const message = err instanceof Error ? err.message : ''
      if (!message.startsWith(FENCED_MARK)) throw err
      if (this.#value === value) this.#stepDown()
      const holder = message.slice(FENCED_MARK.length + 1)
      return { applied: false, holder: holder === '' ? null : holder }
    }
  }

  #run(): Promise<void> {
    const attempt = (this.#value !== undefined ? this.#renew() : this.#acquire()).then(
      () => this.#recovered(),
      (err: unknown) => this.#failed(err),
    )
    this.#inflight = attempt
    return attempt
  }

  async #acquire(): Promise<void> {
    const sentAt = this.#clock.monotonic()
    const [token, value] = (await this.#redis.eval(ACQUIRE, 2, this.#keys.leader, this.#keys.fence, this.#opts.routerId, this.#opts.ttlMs, this.#last ?? '', this.#maxToken)) as [number, string]
    this.#seen(value)
    if (token === 0) return
    this.#last = value
    // stop() came while this was in flight: it releases what we now hold, without a term.
    if (!this.#started) return
    this.#value = value
    this.#token = token
    this.#extend(sentAt)
    this.#opts.logger?.info({ token }, 'this router is the prober leader')
    this.#emit()
  }

  async #renew(): Promise<void> {
    const value = this.#value as string
    const sentAt = this.#clock.monotonic()
    const ok = (await this.#redis.eval(RENEW, 1, this.#keys.leader, value, this.#opts.ttlMs)) as number
    if (this.#value !== value) return
    if (ok === 1) {
      this.#extend(sentAt)
      return
    }
    this.#opts.logger?.warn({ token: this.#token }, 'the prober leader lock was lost (expired or taken); no longer leader')
    this.#stepDown()
  }

  /** The term lasts ttlMs from when the last successful command was sent (Redis set the PX later). */
  #extend(sentAt: number): void {
    this.#deadline = sentAt + this.#opts.ttlMs
    if (this.#expiry) this.#clock.clearTimeout(this.#expiry)
    this.#expiry = this.#clock.setTimeout(() => {
      this.#expiry = undefined
      if (this.#value === undefined || this.#clock.monotonic() < this.#deadline) return
      this.#opts.logger?.warn({ token: this.#token }, 'could not renew the prober leader lock within its TTL; no longer leader')
      this.#stepDown()
    }, this.#deadline - this.#clock.monotonic())
    this.#expiry.unref?.()
  }

  #stepDown(): void {
    if (this.#expiry) this.#clock.clearTimeout(this.#expiry)
    this.#expiry = undefined
    if (this.#value === undefined) return
    this.#value = undefined
    this.#token = undefined
    this.#deadline = 0
    this.#emit()
  }

  #seen(value: string): void {
    const token = Number(value.slice(value.lastIndexOf(':') + 1))
    if (Number.isSafeInteger(token) && token > this.#maxToken) this.#maxToken = token
  }

  #emit(): void {
    const leading = this.#value !== undefined
    callEach(this.#listeners, [leading, this.#token], this.#opts.logger)
  }

  #recovered(): void {
    if (!this.#failing) return
    this.#failing = false
    this.#opts.logger?.info({}, 'the prober leader lock is reachable again')
  }

  #failed(err: unknown): void {
    // Once per outage; the term's own deadline (#extend) decides when a leader stops.
    if (this.#failing) return
    this.#failing = true
    this.#opts.logger?.warn({ err: err instanceof Error ? err.message : String(err) }, 'cannot reach the shared store for the prober leader lock; retrying')
  }
}

/**
 * `script` wrapped so that it runs only while KEYS[1] (the leader key) holds ARGV[1] (this
 * term's value); the script itself sees KEYS and ARGV without those two. A refusal is an error
 * reply starting with FENCED_MARK and naming the holder.
 */
function fence(script: string): string {
  return `local function fenced(KEYS, ARGV)
${script}
end
local cur = redis.call('GET', KEYS[1])
if cur ~= ARGV[1] then return redis.error_reply('${FENCED_MARK} ' .. (cur or '')) end
local keys, argv = {}, {}
for i = 2, #KEYS do keys[#keys + 1] = KEYS[i] end
for i = 2, #ARGV do argv[#argv + 1] = ARGV[i] end
return fenced(keys, argv)
`
}
