import { STATUS_CODES } from 'node:http'
import type { RequestOptions } from 'node:https'
import { createInterface } from 'node:readline'
import type { KubeConfig } from '@kubernetes/client-node'
import { Agent, errors, request } from 'undici'
import type { Random } from '../../../common/random.js'

export interface GuardedWatchOptions {
  /** The API server ends each watch after a random time in [this, 2 × this) (client-go does the same). */
  timeoutSeconds: number
  /** No byte for this long (the API server sends a bookmark about every minute): the watch is dead. */
  idleMs: number
  random: Random
}

/** A watch that carried nothing for `idleMs`: presumed dead (a half-open connection, a stuck proxy). */
export class WatchIdleError extends Error {
  override name = 'WatchIdleError'
}

type Done = (err: unknown) => void

/**
 * The pod watch that discovery hands client-node's ListWatch in place of client-node's own
 * `Watch` (issue 22, defect 4). Theirs asks the API server for no timeout and has none of its
 * own (1.4 builds a 30 s abort signal, then overwrites it), so a watch whose connection died
 * without a FIN or RST (a node's network, a load balancer's idle cut, a NAT table flushed)
 * stays open and silent: scale-ups are missed until the process restarts. This one
 * - asks for `timeoutSeconds` (jittered) and for bookmarks, so a healthy watch always
 *   carries something within about a minute and ends by itself in minutes;
 * - fails a watch that carried no byte for `idleMs`, or whose response head did not come
 *   within it, with WatchIdleError (ListWatch reports it as an error; discovery starts the
 *   watch again from its resourceVersion);
 * - can end the watch under way as expired (`expire`): ListWatch then lists again and diffs
 *   the list against its cache, which is how discovery re-lists periodically.
 * Each watch gets its own connection (a watch lives for minutes; a pooled socket that went
 * silent must not be handed to the next one).
 */
export class GuardedWatch {
  readonly config: KubeConfig
  readonly #o: GuardedWatchOptions
  #current: Done | undefined

  constructor(config: KubeConfig, opts: GuardedWatchOptions) {
    this.config = config
    this.#o = opts
  }

  /** client-node's Watch contract: `done` once, with null when the server ended the watch. */
  async watch(path: string, queryParams: Record<string, unknown>, callback: (phase: string, apiObj: unknown, watchObj?: unknown) => void, done: Done): Promise<AbortController> {
    const controller = new AbortController()
    let dispatcher: Agent | undefined
    let ended = false
    const end: Done = (err) => {
      if (ended) return
      ended = true
      if (this.#current === end) this.#current = undefined
      controller.abort()
      void dispatcher?.destroy().catch(() => {})
      done(err)
    }
    this.#current = end
    try {
      const opts: RequestOptions = {}
      await this.config.applyToHTTPSOptions(opts)
      const cluster = this.config.getCurrentCluster()
      if (!cluster) throw new Error('No currently active cluster')
      const url = new URL(cluster.server + path)
      for (const [k, v] of Object.entries(queryParams)) if (v !== undefined) url.searchParams.set(k, String(v))
      const timeoutSeconds = Math.floor(this.#o.timeoutSeconds * (1 + this.#o.random.next()))
      url.searchParams.set('watch', 'true')
      url.searchParams.set('allowWatchBookmarks', 'true')
      url.searchParams.set('timeoutSeconds', String(timeoutSeconds))
      const headers: Record<string, string> = {}
      for (const [k, v] of Object.entries(opts.headers ?? {})) if (v !== undefined) headers[k.toLowerCase()] = Array.isArray(v) ? v.join(', ') : String(v)
      if (opts.auth) headers.authorization = `Basic ${Buffer.from(opts.auth).toString('base64')}`
      dispatcher = new Agent({
        connections: 1,
        connect: {
          ...(opts.ca ? { ca: opts.ca } : {}),
          ...(opts.cert ? { cert: opts.cert } : {}),
          ...(opts.key ? { key: opts.key } : {}),
          ...(opts.pfx ? { pfx: opts.pfx } : {}),
          ...(opts.passphrase ? { passphrase: opts.passphrase } : {}),
          ...(opts.rejectUnauthorized !== undefined ? { rejectUnauthorized: opts.rejectUnauthorized } : {}),
          ...(opts.servername ? { servername: opts.servername } : {}),
        },
      })
      const res = await request(url, { dispatcher, headers, signal: controller.signal, headersTimeout: this.#o.idleMs, bodyTimeout: this.#o.idleMs })
      if (res.statusCode !== 200) {
        const body = await res.body.text().catch(() => '')
        throw Object.assign(new Error(STATUS_CODES[res.statusCode] ?? `HTTP ${res.statusCode}`), { statusCode: res.statusCode, body })
      }
      // First: an error ends the watch with it, before readline's close could end it cleanly.
      const failed = (err: unknown): void => end(idle(err) ? new WatchIdleError(`the pod watch carried nothing for ${this.#o.idleMs} ms`) : err)
      res.body.on('error', failed)
      const lines = createInterface({ input: res.body, crlfDelay: Infinity })
      lines.on('error', failed) // readline passes the body's error on
      lines.on('line', (line) => {
        if (ended) return
        let data: { type?: unknown; object?: unknown }
        try {
          data = JSON.parse(line) as typeof data
        } catch {
          return // a torn line of a watch that is ending
        }
        callback(String(data.type), data.object, data)
      })
      lines.on('close', () => end(null))
    } catch (err) {
      end(idle(err) ? new WatchIdleError(`the pod watch's response head did not come within ${this.#o.idleMs} ms`) : err)
    }
    return controller
  }

  /** Ends the watch under way as expired (410): its ListWatch lists again. False when none is under way. */
  expire(): boolean {
    const end = this.#current
    if (!end) return false
    end(Object.assign(new Error('periodic re-list'), { statusCode: 410 }))
    return true
  }
}

function idle(err: unknown): boolean {
  return err instanceof errors.BodyTimeoutError || err instanceof errors.HeadersTimeoutError
}
