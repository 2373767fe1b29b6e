import { Readable } from 'node:stream'
import { request, type Dispatcher } from 'undici'
import type { CodedError, RouterErrorCode } from '../errors.js'
import type { RouterMetrics } from '../metrics.js'
import type { TopologyRegistry } from '../topology/registry.js'
import type { Payload } from './shared-body.js'
import { ClientGone } from './exchange.js'
import { isConnectFailure, mapUpstreamFailure, upstreamErrorDetail, type Leg, type UpstreamFailure } from './upstream-errors.js'

/**
 * Bodies up to this size are copied into one Buffer per leg (a copy of at most 256 KiB per leg
 * in flight); larger ones are sent as their shared chunks, so a batch never multiplies a big body.
 */
const COALESCE_BYTES = 256 * 1024

export interface UpstreamTarget {
  readonly id: string
  readonly url: string
}

export interface UpstreamCall {
  target: UpstreamTarget
  leg: Leg
  path: string
  /** The body's JSON as Buffers shared with the request's other legs (shared-body.ts). */
  payload: Payload
  headers: Record<string, string>
  /** The exchange's signal: the client left. */
  signal: AbortSignal
  headersTimeoutMs: number
  bodyTimeoutMs: number
  /** A deadline for the whole answer, head and body (the prefill leg). */
  deadlineMs?: number
}

/** An upstream leg that failed, already mapped to the router error the client will see. */
export class LegFailure extends Error {
  constructor(readonly error: CodedError & { code: RouterErrorCode }) {
    super(error.message)
  }

  /** The engine never got the request: it may go to another instance. */
  get retryable(): boolean {
    return isConnectFailure(this.error)
  }
}

export interface UpstreamAnswer {
  res: Dispatcher.ResponseData
  /** Aborts when the client leaves or the call's deadline passes; reads of `res.body` honour it. */
  signal: AbortSignal
  /** Stops the deadline timer once the answer is read. */
  settle(): void
  /** performance.now() when the call went out (firstToken measures from it). */
  sentAt: number
}

class DeadlinePassed extends Error {}

/**
 * Talks to engines. Every failure of a call is mapped here, once, and only a failure to
 * connect is reported to the registry against the instance's health.
 */
export class Upstream {
  readonly #dispatcher: Dispatcher
  readonly #registry: TopologyRegistry
  readonly #metrics: RouterMetrics
  readonly #onFirstToken: ((id: string, ms: number) => void) | undefined

  /** `onFirstToken`: hears how long each engine took to its first token (adaptive-limits.ts). */
  constructor(opts: { dispatcher: Dispatcher; registry: TopologyRegistry; metrics: RouterMetrics; onFirstToken?: (id: string, ms: number) => void }) {
    this.#dispatcher = opts.dispatcher
    this.#registry = opts.registry
    this.#metrics = opts.metrics
    this.#onFirstToken = opts.onFirstToken
  }

  /** The engine's first token came in this answer (P's whole answer, D's first streamed frame). */
  firstToken(call: UpstreamCall, answer: UpstreamAnswer): void {
    this.#onFirstToken?.(call.target.id, performance.now() - answer.sentAt)
  }

  async send(call: UpstreamCall): Promise<UpstreamAnswer> {
    const sentAt = performance.now()
    const deadline = call.deadlineMs === undefined ? undefined : withDeadline(call.signal, call.deadlineMs)
    const signal = deadline ? deadline.signal : call.signal
    const settle = (): void => deadline?.clear()
    // A body up to COALESCE_BYTES goes out as one Buffer: one write, no stream. A larger one (a
    // batch sharing a big pass-through field) as its shared Buffers one after another, none
    // copied, a fresh stream per try. Sent chunk by chunk through a stream, every body cost a
    // stream and several socket writes per leg: up to 50% more router CPU per request
    // (docs/benchmarks.md, "Router overhead").
    const whole = call.payload.bytes <= COALESCE_BYTES ? Buffer.concat(call.payload.chunks, call.payload.bytes) : undefined
    const options = () => ({
      method: 'POST' as const,
      body: whole ?? Readable.from(call.payload.chunks),
      headers: { ...call.headers, 'content-length': String(call.payload.bytes) },
      signal,
      dispatcher: this.#dispatcher,
      headersTimeout: call.headersTimeoutMs,
      bodyTimeout: call.bodyTimeoutMs,
    })
    const url = call.target.url + call.path
    try {
      let res: Dispatcher.ResponseData
      try {
        res = await request(url, options())
      } catch (err) {
        // An idle keep-alive socket the engine closed just as the request went out: the engine
        // never read it, so it is sent once more on a fresh connection.
        if (signal.aborted || !closedWhileIdle(err)) throw err
        res = await request(url, options())
      }
      // It answered: whatever the status, the instance is reachable.
      this.#registry.recordSuccess(call.target.id)
      return { res, signal, settle, sentAt }
    } catch (err) {
      settle()
      throw this.#failure(call, signal, err)
    }
  }

  /** The whole body; a failure while reading is mapped like one while sending. */
  async readAll(call: UpstreamCall, answer: UpstreamAnswer): Promise<Buffer> {
    try {
      return Buffer.from(await answer.res.body.arrayBuffer())
    } catch (err) {
      throw this.#failure(call, answer.signal, err)
    } finally {
      answer.settle()
    }
  }

  /** An engine's 5xx: mapped to a 502 (not a health failure: a bad input can cause it). */
  statusFailure(call: UpstreamCall, status: number, body: Buffer): LegFailure {
    return this.fail(call, { kind: 'status', status, detail: upstreamErrorDetail(body.toString('utf8')) })
  }

  fail(call: UpstreamCall, failure: UpstreamFailure): LegFailure {
    const error = mapUpstreamFailure(failure, call.leg, call.target.id)
    const failed = new LegFailure(error)
    if (failed.retryable) this.#registry.recordFailure(call.target.id)
    this.#metrics.upstreamErrors.inc({ leg: call.leg, code: error.code })
    return failed
  }

  #failure(call: UpstreamCall, signal: AbortSignal, err: unknown): Error {
    if (call.signal.aborted) return call.signal.reason instanceof Error ? call.signal.reason : new ClientGone()
    if (signal.aborted && signal.reason instanceof DeadlinePassed) {
      return this.fail(call, { kind: 'transport', cause: Object.assign(new Error(`no whole answer within ${call.deadlineMs} ms`), { code: 'ETIMEDOUT' }) })
    }
    return this.fail(call, { kind: 'transport', cause: err })
  }
}

/**
 * A signal that aborts with the parent or after `ms`. Built by hand: AbortSignal.any on
 * Node 20 tracks its sources through weak references and a FinalizationRegistry, which showed
 * up as several times the garbage-collection time of the whole router in a CPU profile.
 */
function withDeadline(parent: AbortSignal, ms: number): { signal: AbortSignal; clear(): void } {
  const ac = new AbortController()
  const onParent = (): void => ac.abort(parent.reason)
  const timer = setTimeout(() => ac.abort(new DeadlinePassed()), ms)
  timer.unref()
  if (parent.aborted) onParent()
  else parent.addEventListener('abort', onParent, { once: true })
  return {
    signal: ac.signal,
    clear: () => {
      clearTimeout(timer)
      parent.removeEventListener('abort', onParent)
    },
  }
}

/**
 * undici reports "other side closed" with the socket's byte counts. Bytes read before any
 * answer to this request came from earlier answers: the socket was reused, and the engine
 * closed it while idle. On a fresh socket the same error means the engine died on this request,
 * which is never retried.
 */
function closedWhileIdle(err: unknown): boolean {
  const e = err as { code?: unknown; socket?: { bytesRead?: unknown } } | undefined
  return e?.code === 'UND_ERR_SOCKET' && typeof e.socket?.bytesRead === 'number' && e.socket.bytesRead > 0
}
