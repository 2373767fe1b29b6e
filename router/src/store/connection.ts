import { Redis, type RedisOptions } from 'ioredis'
import { type Clock, systemClock } from '../../../common/clock.js'
import { callEach, type StoreLogger, type StoreState, type StoreStateListener } from './store-state.js'

export type { StoreLogger, StoreState, StoreStateListener } from './store-state.js'

/**
 * How long a live reader's XREAD blocks, ms. Redis answers a block that found nothing when it
 * ends, so a reader's connection that carries no byte for this long plus `commandTimeoutMs` is
 * dead (a link that drops packets without a reset), and is dropped and opened again.
 */
export const READER_BLOCK_MS = 1000

/** What a StoreConnection counts: `up` set to 1 while ok, 0 while degraded; `lost` a connection that was ready and closed. */
export interface StoreConnectionMetrics {
  up: { set(value: number): void }
  lost?: { inc(labels: { connection: 'command' | 'reader' }): void }
}

export interface StoreConnectionOptions {
  /**
   * As in `store.url`: redis://[[user]:password@]host:port[/db] or rediss://…, or through
   * Sentinel redis+sentinel://[[user]:password@]host:port[,host:port…]/master[/db] (the
   * sentinels' addresses and the master's name; rediss+sentinel:// for TLS, and
   * `?sentinelPassword=` when the sentinels want one). See `redisOptions`.
   */
  url: string
  /** `store.commandTimeoutMs`: a command without a reply by then fails, and the socket is dropped. Default 1000. */
  commandTimeoutMs?: number
  /** How long `open()`/`whenReady()` wait for the first connection, ms (default 10 s). */
  connectTimeoutMs?: number
  /** The reconnect backoff's cap, ms (default 2000). It grows from 25 ms and never stops retrying. */
  maxBackoffMs?: number
  clock?: Clock
  /** Jitter for the backoff, in [0, 1) (default Math.random). */
  random?: () => number
  logger?: StoreLogger
  metrics?: StoreConnectionMetrics
}

/**
 * The Redis connections of one router (issue 10), tuned so that routing survives a Redis
 * outage: while disconnected, commands fail at once (no offline queue, nothing resent after a
 * reconnect) instead of piling up; a command that gets no reply within `commandTimeoutMs`
 * fails and drops the socket (so a hung Redis also counts as down); reconnection never stops,
 * with a capped, jittered backoff; 'error' events are recorded, never thrown.
 *
 * Before the first `ready`, commands wait for it, but fail with each failed connection
 * attempt; `open()` (or `whenReady()`) is the way to wait.
 *
 * The state is ok while the command connection and every reader connection that was ever
 * ready are ready: a router whose reader is cut gets no events, so it is degraded too.
 */
export class StoreConnection {
  /** The command connection. Not for blocking reads: those take a `duplicate()`. */
  readonly client: Redis
  readonly url: string
  readonly #clock: Clock
  readonly #opts: StoreConnectionOptions
  readonly #duplicates = new Set<Redis>()
  /** Duplicates that were ready once: from then on, one that is not counts against the state. */
  readonly #started = new WeakSet<Redis>()
  readonly #listeners = new Set<StoreStateListener>()
  readonly #ready: Promise<void>
  #state: StoreState
  #closed = false

  /** Connects and waits for the first `ready`; rejects (and closes) after `connectTimeoutMs`. */
  static async open(opts: StoreConnectionOptions): Promise<StoreConnection> {
    const conn = new StoreConnection(opts)
    try {
      await conn.whenReady()
    } catch (err) {
      await conn.close()
      throw err
    }
    return conn
  }

  constructor(opts: StoreConnectionOptions) {
    const commandTimeoutMs = opts.commandTimeoutMs ?? 1000
    if (!(Number.isInteger(commandTimeoutMs) && commandTimeoutMs > 0)) throw new RangeError(`commandTimeoutMs must be a positive integer, got ${commandTimeoutMs}`)
    const target = redisOptions(opts.url)
    this.#opts = opts
    this.#clock = opts.clock ?? systemClock
    this.url = redactUrl(opts.url)
    this.#state = Object.freeze({ state: 'degraded', since: this.#clock.now(), error: 'not connected yet' })
    opts.metrics?.up.set(0)
    const maxBackoffMs = opts.maxBackoffMs ?? 2000
    const random = opts.random ?? Math.random
    const options: RedisOptions = {
      // Until the first `ready`, commands wait for it (failing with each failed attempt, see
      // maxRetriesPerRequest); from then on they fail at once while disconnected.
      enableOfflineQueue: true,
      // In-flight commands fail on a disconnect instead of being resent after it: a caller that
      // got an error may retry, but nothing it gave up on runs later behind its back.
      maxRetriesPerRequest: 0,
      autoResendUnfulfilledCommands: false,
      commandTimeout: commandTimeoutMs,
      socketTimeout: commandTimeoutMs,
      connectTimeout: Math.max(commandTimeoutMs, 1000),
      retryStrategy: (times) => {
        const cap = Math.min(maxBackoffMs, 25 * 2 ** Math.min(times, 16))
        return Math.round(cap / 2 + (random() * cap) / 2)
      },
    }
    this.client = failFastOnceReady(typeof target === 'string' ? new Redis(target, options) : new Redis({ ...target, ...options }))
    // Code handed only the client (the event store's and the shared topology's live readers)
    // duplicates it for XREAD BLOCK: a plain copy would carry the command timeout and cut every
    // block short. Its copies are this class's reader-safe ones, closed with it.
    this.client.duplicate = (override) => this.duplicate(override)
    this.client.on('error', (err: Error) => this.#error(err))
    this.#watch(this.client, 'command')
    this.#ready = new Promise<void>((resolve) => {
      if (this.client.status === 'ready') resolve()
      else this.client.once('ready', () => resolve())
    })
    this.#ready.catch(() => {})
  }

  get state(): StoreState {
    return this.#state
  }

  /** Calls `listener` on every change between ok and degraded; returns the unsubscribe. */
  onChange(listener: StoreStateListener): () => void {
    this.#listeners.add(listener)
    return () => {
      this.#listeners.delete(listener)
    }
  }

  /**
   * Resolves on the first successful connection (at once if there was one); rejects after
   * `timeoutMs` (default `connectTimeoutMs`) with the URL, without its password, and the last error.
   */
  whenReady(timeoutMs = this.#opts.connectTimeoutMs ?? 10_000): Promise<void> {
    return new Promise((resolve, reject) => {
      const timer = this.#clock.setTimeout(() => {
        reject(new Error(`the shared store at ${this.url} did not answer within ${timeoutMs} ms (${this.#state.error ?? 'no error reported'})`))
      }, timeoutMs)
      timer.unref?.()
      this.#ready.then(() => {
        this.#clock.clearTimeout(timer)
        resolve()
      })
    })
  }

  /**
   * A new connection with the same settings, for live readers (XREAD BLOCK READER_BLOCK_MS):
   * no `commandTimeout` (it would cut every block short); instead a socket that carries no
   * byte for READER_BLOCK_MS + `commandTimeoutMs` after a command is destroyed (a reconnect
   * follows, and the pending read fails: the reader resumes from its cursor). ioredis's guard
   * on blocking commands stays as a backstop, later. Its errors are recorded like the command
   * connection's, and it counts in the state once it was ready; `close()` closes it too.
   * So a read on it must not block for longer than READER_BLOCK_MS.
   * `client.duplicate()` comes here as well. `override` is applied last (ioredis options).
   */
  duplicate(override: Partial<RedisOptions> = {}): Redis {
    const timeout = this.#opts.commandTimeoutMs ?? 1000
    const dup = failFastOnceReady(
      new Redis({
        ...this.client.options,
        enableOfflineQueue: true,
        commandTimeout: undefined,
        socketTimeout: READER_BLOCK_MS + timeout,
        blockingTimeout: 60_000,
        blockingTimeoutGrace: 2 * timeout,
        ...override,
      }),
    )
    dup.on('error', (err: Error) => this.#error(err))
    this.#watch(dup, 'reader')
    dup.once('end', () => {
      this.#duplicates.delete(dup)
      this.#set(this.#healthy() ? 'ok' : 'degraded')
    })
    this.#duplicates.add(dup)
    if (this.#closed) dup.disconnect()
    return dup
  }

  /** Quits every connection (the duplicates too); no more changes are reported. */
  async close(): Promise<void> {
    if (this.#closed) return
    this.#closed = true
    this.#listeners.clear()
    // A duplicate may sit in a blocking read that a QUIT would queue behind: cut it.
    for (const dup of this.#duplicates) dup.disconnect()
    await quit(this.client, this.#opts.commandTimeoutMs ?? 1000)
  }

  /** Follows a connection's readiness into the state, and counts a ready one that closed. */
  #watch(redis: Redis, connection: 'command' | 'reader'): void {
    let live = false
    redis.on('ready', () => {
      live = true
      this.#started.add(redis)
      this.#set(this.#healthy() ? 'ok' : 'degraded')
    })
    redis.on('close', () => {
      // Once per loss: the failed attempts to connect again close too.
      if (live && !this.#closed) this.#opts.metrics?.lost?.inc({ connection })
      live = false
      this.#set('degraded')
    })
  }

  #healthy(): boolean {
    if (this.client.status !== 'ready') return false
    for (const dup of this.#duplicates) if (this.#started.has(dup) && dup.status !== 'ready') return false
    return true
  }

  #error(err: Error): void {
    const error = redactText(err.message, this.#opts.url)
    if (this.#state.error === error) return
    // A detail of the current state, not a change: listeners hear of ok ↔ degraded only.
    this.#state = Object.freeze({ ...this.#state, error })
  }

  #set(state: 'ok' | 'degraded'): void {
    if (this.#closed || this.#state.state === state) return
    const error = state === 'ok' ? undefined : (this.#state.error ?? 'connection closed')
    this.#state = Object.freeze(error === undefined ? { state, since: this.#clock.now() } : { state, since: this.#clock.now(), error })
    this.#opts.metrics?.up.set(state === 'ok' ? 1 : 0)
    if (state === 'ok') this.#opts.logger?.info({ store: this.url }, 'shared store reachable')
    else this.#opts.logger?.warn({ store: this.url, err: error }, 'shared store unreachable; routing continues, shared writes fail until it is back')
    callEach(this.#listeners, [this.#state], this.#opts.logger)
  }
}

/**
 * What ioredis is given for a `store.url`: a redis:// or rediss:// URL as it is; a
 * redis+sentinel:// one as Sentinel options (issue 21 item 7). Through Sentinel the client asks
 * the sentinels for the master's address on every (re)connection. Without ioredis's failover
 * detector: with it (ioredis 6.0.0), a client that was reconnecting when the sentinels
 * announced the new master ended for good ("Connection is closed." from then on), and its
 * router stayed cut off from Redis; without it, the client finds the promoted replica at its
 * next reconnect, within a second or two of the promotion (test/chaos/sentinel.test.ts).
 */
export function redisOptions(url: string): string | RedisOptions {
  if (/^rediss?:\/\//.test(url)) return url
  const m = /^(rediss?)\+sentinel:\/\/(?:([^@/]*)@)?([^/?#]+)\/([^/?#]+)(?:\/(\d+))?\/?(?:\?([^#]*))?$/.exec(url)
  if (!m) throw new RangeError(`store url must be redis://, rediss://, redis+sentinel://host:port[,host:port…]/master[/db] or rediss+sentinel://…, got '${redactUrl(url)}'`)
  const [, scheme, auth, hosts, name, db, query] = m as unknown as [string, string, string | undefined, string, string, string | undefined, string | undefined]
  const sentinels = hosts.split(',').map((h) => {
    const hp = /^(\[[^\]]+\]|[^:]+)(?::(\d+))?$/.exec(h)
    if (!hp) throw new RangeError(`store url: not a sentinel address: '${h}'`)
    return { host: (hp[1] as string).replace(/^\[|\]$/g, ''), port: hp[2] ? Number(hp[2]) : 26379 }
  })
  const [user, password] = auth === undefined ? [] : auth.includes(':') ? [auth.slice(0, auth.indexOf(':')), auth.slice(auth.indexOf(':') + 1)] : [auth]
  const params = new URLSearchParams(query ?? '')
  const sentinelPassword = params.get('sentinelPassword')
  const tls = scheme === 'rediss'
  return {
    sentinels,
    name: decodeURIComponent(name),
    ...(user ? { username: decodeURIComponent(user) } : {}),
    ...(password ? { password: decodeURIComponent(password) } : {}),
    ...(db ? { db: Number(db) } : {}),
    ...(sentinelPassword ? { sentinelPassword } : {}),
    ...(tls ? { tls: {}, sentinelTLS: {}, enableTLSForSentinelMode: true } : {}),
  }
}

/** `url` with its password replaced by `***` (for logs and errors); an unparsable one is not echoed. */
export function redactUrl(url: string): string {
  if (/^rediss?\+sentinel:\/\//.test(url)) {
    // Several hosts: not a WHATWG URL. The password in the userinfo and the sentinels' go.
    return url.replace(/^([^:]+:\/\/[^:@/]*):[^@/]*@/, '$1:***@').replace(/([?&]sentinelPassword=)[^&#]*/, '$1***')
  }
  try {
    const u = new URL(url)
    if (u.password) u.password = '***'
    return u.toString()
  } catch {
    return '<unparsable url>'
  }
}

function redactText(text: string, url: string): string {
  const secrets: string[] = []
  try {
    const options = redisOptions(url)
    if (typeof options === 'string') secrets.push(decodeURIComponent(new URL(url).password))
    else secrets.push(options.password ?? '', options.sentinelPassword ?? '')
  } catch {}
  for (const secret of secrets) if (secret) text = text.split(secret).join('***')
  return text
}

function failFastOnceReady(redis: Redis): Redis {
  redis.once('ready', () => {
    redis.options.enableOfflineQueue = false
  })
  return redis
}

/** QUIT if connected (bounded by `ms`), else drop the socket and stop reconnecting. */
async function quit(redis: Redis, ms: number): Promise<void> {
  if (redis.status === 'end') return
  if (redis.status !== 'ready') return redis.disconnect()
  const ended = new Promise<void>((resolve) => {
    redis.once('end', resolve)
    setTimeout(resolve, ms).unref()
  })
  await redis.quit().catch(() => redis.disconnect())
  await ended
  // A QUIT closes the socket but not always what the connector holds besides (through
  // Sentinel, its connections to the sentinels): disconnect() releases those.
  redis.disconnect()
}

// Redis's own answers that pass: a server loading its data, a replica not yet promoted or
// lagging, a busy script, memory full until something is evicted.
const PASSING_REPLIES = /^(LOADING|READONLY|MASTERDOWN|NOREPLICAS|BUSY|TRYAGAIN|CLUSTERDOWN|OOM|NOSCRIPT)\b/

/**
 * Whether a failed command is worth sending again: no answer at all (connection lost, refused,
 * timed out, the offline queue full) or one of Redis's passing answers. Any other answer (a
 * script error, a wrong type) and any error of ours would fail the same way every time.
 */
export function retryableRedisError(err: unknown): boolean {
  if (!(err instanceof Error)) return false
  if (err.name === 'ReplyError') return PASSING_REPLIES.test(err.message)
  return err.name === 'MaxRetriesPerRequestError' || /Connection is closed|Command timed out|Stream isn't writeable|ECONNREFUSED|ECONNRESET|ETIMEDOUT|EPIPE|EHOSTUNREACH|ENETUNREACH|connect/i.test(err.message)
}
