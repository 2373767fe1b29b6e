import { STATUS_CODES } from 'node:http'
import type { RequestOptions } from 'node:https'
import { createInterface } from 'node:readline'
import type { KubeConfig } from '@kubernetes/client-node'
import { Agent, errors, request } from 'undici'
import type { Random } from '../../../common/random.js'

export interface KubeHttpOptions {
  /** The API server ends each watch after a random time in [this, 2 × this) (client-go does the same). */
  timeoutSeconds: number
  /** No byte for this long (the API server sends a bookmark about every minute): the call is dead. */
  idleMs: number
  random: Random
}

/** A watch or list that carried nothing for `idleMs`: presumed dead (a half-open connection, a stuck proxy). */
export class WatchIdleError extends Error {
  override name = 'WatchIdleError'
}

type Done = (err: unknown) => void

/**
 * The two API calls discovery makes, list and watch, for client-node's ListWatch (which takes
 * this in place of client-node's own `Watch`; issue 22, defect 4). Theirs asks the API server
 * for no timeout and has none of its own (1.4 builds a 30 s abort signal, then overwrites
 * it), so a watch whose connection died without a FIN or RST (a node's network, a load
 * balancer's idle cut, a NAT table flushed) stays open and silent: scale-ups are missed until
 * the process restarts. Here
 * - a watch asks for `timeoutSeconds` (jittered) and for bookmarks, so a healthy one always
 *   carries something within about a minute and ends by itself in minutes;
 * - a watch or list that carried no byte for `idleMs`, or whose response head did not come
 *   within it, fails with WatchIdleError (ListWatch reports it as an error; discovery starts
 *   again from the last resourceVersion);
 * - the watch under way can be ended as expired (`expire`): ListWatch then lists again and
 *   diffs the list against its cache, which is how discovery re-lists periodically;
 * - each call gets a connection of its own: a pooled socket that went silent must not be
 *   handed to the next call, which would hang on it in turn.
 * Objects come as the API server sends them (JSON), untyped like a watch's events.
 */
export class KubeHttp {
  readonly config: KubeConfig
  readonly #o: KubeHttpOptions
  #current: Done | undefined

  constructor(config: KubeConfig, opts: KubeHttpOptions) {
    this.config = config
    this.#o = opts
  }

  /** GET `path` with `query`, parsed; rejects with the status (and the API server's Status as `body`) on anything but 200. */
  async list<T>(path: string, query: Record<string, string>): Promise<T> {
    const { url, headers, dispatcher } = await this.#prepare(path, query)
    try {
      const res = await request(url, { dispatcher, headers, headersTimeout: this.#o.idleMs, bodyTimeout: this.#o.idleMs })
      const body = await res.body.text()
      if (res.statusCode !== 200) throw statusError(res.statusCode, body)
      return JSON.parse(body) as T
    } catch (err) {
      throw idle(err) ? new WatchIdleError(`the pod list carried nothing for ${this.#o.idleMs} ms`) : err
    } finally {
      void dispatcher.destroy().catch(() => {})
    }
  }

  /** The URL, headers and a one-connection dispatcher with the KubeConfig's credentials and TLS settings. */
  async #prepare(path: string, query: Record<string, unknown>): Promise<{ url: URL; headers: Record<string, string>; dispatcher: Agent }> {
    const opts: RequestOptions = {}
    await this.config.applyToHTTPSOptions(opts)
    const cluster = this.config.getCurrentCluster()
    if (!cluster) throw new Error('No currently active cluster')
    const url = new URL(cluster.server + path)
    for (const [k, v] of Object.entries(query)) if (v !== undefined) url.searchParams.set(k, String(v))
    const headers: Record<string, string> = { accept: 'application/json' }
    for (const [k, v] of Object.entries(opts.headers ?? {})) if (v !== undefined) headers[k.toLowerCase()] = Array.isArray(v) ? v.join(', ') : String(v)
    if (opts.auth) headers.authorization = `Basic ${Buffer.from(opts.auth).toString('base64')}`
    const dispatcher = new Agent({
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
    return { url, headers, dispatcher }
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
      const timeoutSeconds = Math.floor(this.#o.timeoutSeconds * (1 + this.#o.random.next()))
      const prepared = await this.#prepare(path, { ...queryParams, watch: 'true', allowWatchBookmarks: 'true', timeoutSeconds: String(timeoutSeconds) })
      dispatcher = prepared.dispatcher
      if (ended) throw new Error('ended before it began')
      const res = await request(prepared.url, { dispatcher, headers: prepared.headers, signal: controller.signal, headersTimeout: this.#o.idleMs, bodyTimeout: this.#o.idleMs })
      if (res.statusCode !== 200) throw statusError(res.statusCode, await res.body.text().catch(() => ''))
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

/** As client-node reports a failed call: `statusCode`, and the API server's Status (JSON text) as `body`. */
function statusError(status: number, body: string): Error {
  return Object.assign(new Error(STATUS_CODES[status] ?? `HTTP ${status}`), { statusCode: status, body })
}

function idle(err: unknown): boolean {
  return err instanceof errors.BodyTimeoutError || err instanceof errors.HeadersTimeoutError
}
