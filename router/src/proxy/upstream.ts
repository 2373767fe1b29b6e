import { Readable } from 'node:stream'
import type { IncomingHttpHeaders } from 'node:http'
import type { Dispatcher } from 'undici'
import { AnswerBody } from './answer-body.js'
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
  /** A deadline for the whole answer, head and body (the prefill leg; a decode leg whose read its whole answer proves). */
  deadlineMs?: number
  /** What the call fails with when deadlineMs passes, instead of a timeout failure (not the engine's fault). */
  deadlineError?: () => Error
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
  readonly statusCode: number
  readonly headers: IncomingHttpHeaders
  /** Fails when the client leaves, the call's deadline passes or the connection breaks. */
  readonly body: AnswerBody
  /** performance.now() when the call went out (firstToken measures from it). */
  readonly sentAt: number
}

class DeadlinePassed extends Error {}

/**
 * Talks to engines. Every failure of a call is mapped here, once, and only a failure to
 * connect is reported to the registry against the instance's health.
 *
 * Calls go through undici's dispatch with a handler of our own (InFlight) rather than
 * request(): no Readable per answer, no signal wiring inside undici, the body read whole or
 * chunk by chunk from AnswerBody. On the two-leg path that was a fifth of the router's CPU
 * per request (docs/benchmarks.md, "Router CPU per request").
 */
export class Upstream {
  readonly #dispatcher: Dispatcher
  readonly #registry: TopologyRegistry
  readonly #metrics: RouterMetrics
  readonly #onFirstToken: ((id: string, ms: number) => void) | undefined
  /** Target URLs' origins and path prefixes, parsed once each. */
  readonly #origins = new Map<string, { origin: string; prefix: string }>()

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
    // A body up to COALESCE_BYTES goes out as one Buffer: one write, no stream. A larger one (a
    // batch sharing a big pass-through field) as its shared Buffers one after another, none
    // copied, a fresh stream per try. Sent chunk by chunk through a stream, every body cost a
    // stream and several socket writes per leg: up to 50% more router CPU per request
    // (docs/benchmarks.md, "Router overhead").
    const whole = call.payload.bytes <= COALESCE_BYTES ? Buffer.concat(call.payload.chunks, call.payload.bytes) : undefined
    const { origin, prefix } = this.#origin(call.target.url)
    const options = (): Dispatcher.DispatchOptions => ({
      origin,
      path: prefix + call.path,
      method: 'POST',
      body: whole ?? Readable.from(call.payload.chunks),
      headers: { ...call.headers, 'content-length': String(call.payload.bytes) },
      headersTimeout: call.headersTimeoutMs,
      bodyTimeout: call.bodyTimeoutMs,
    })
    const sentAt = performance.now()
    // A connect failure while the engine answers others is a busy engine, not a dead one (registry.ts, HealthPolicy).
    const answersBefore = this.#registry.answers(call.target.id)
    const flight = new InFlight(call, sentAt, this.#registry)
    let answer: UpstreamAnswer
    try {
      try {
        answer = await flight.dispatch(this.#dispatcher, options())
      } catch (err) {
        // An idle keep-alive socket the engine closed just as the request went out: the engine
        // never read it, so it is sent once more on a fresh connection.
        if (flight.stopped || !closedWhileIdle(err)) throw err
        answer = await flight.dispatch(this.#dispatcher, options())
      }
    } catch (err) {
      flight.close()
      throw this.#failure(call, err, answersBefore)
    }
    // It answered: whatever the status, the instance is reachable.
    this.#registry.recordSuccess(call.target.id, answer.statusCode)
    return answer
  }

  /** The whole body; a failure while reading is mapped like one while sending. */
  async readAll(call: UpstreamCall, answer: UpstreamAnswer): Promise<Buffer> {
    try {
      return await answer.body.whole()
    } catch (err) {
      throw this.#failure(call, err)
    }
  }

  /** An engine's 5xx: mapped to a 502 (not a health failure: a bad input can cause it). */
  statusFailure(call: UpstreamCall, status: number, body: Buffer): LegFailure {
    return this.fail(call, { kind: 'status', status, detail: upstreamErrorDetail(body.toString('utf8')) })
  }

  /** `answersBefore`: the registry's answer mark when the call went out (a failure before any answer). */
  fail(call: UpstreamCall, failure: UpstreamFailure, answersBefore?: number): LegFailure {
    const error = mapUpstreamFailure(failure, call.leg, call.target.id)
    const failed = new LegFailure(error)
    if (failed.retryable) this.#registry.recordFailure(call.target.id, answersBefore)
    this.#metrics.upstreamErrors.inc({ leg: call.leg, code: error.code })
    return failed
  }

  #failure(call: UpstreamCall, err: unknown, answersBefore?: number): Error {
    if (call.signal.aborted) return reasonOf(call.signal)
    if (err instanceof DeadlinePassed) {
      if (call.deadlineError) return call.deadlineError()
      return this.fail(call, { kind: 'transport', cause: Object.assign(new Error(`no whole answer within ${call.deadlineMs} ms`), { code: 'ETIMEDOUT' }) })
    }
    return this.fail(call, { kind: 'transport', cause: err }, answersBefore)
  }

  #origin(url: string): { origin: string; prefix: string } {
    let o = this.#origins.get(url)
    if (!o) {
      // Instances come and go (discovery): the cache starts over rather than grow for ever.
      if (this.#origins.size >= 1024) this.#origins.clear()
      const u = new URL(url)
      o = { origin: u.origin, prefix: u.pathname.replace(/\/+$/, '') }
      this.#origins.set(url, o)
    }
    return o
  }
}

/**
 * One call in flight, as undici's dispatch handler: it answers `dispatch` with the head,
 * feeds the body, and stops the call when the client leaves (the call's signal) or its
 * deadline passes. `close` is its end, whichever way the call ended.
 */
class InFlight implements Dispatcher.DispatchHandler {
  readonly #call: UpstreamCall
  readonly #sentAt: number
  /** Hears that the answer ended: the engine is alive (a long stream's head may be minutes old). */
  readonly #registry: Pick<TopologyRegistry, 'recordSuccess'>
  readonly #timer: NodeJS.Timeout | undefined
  #controller: Dispatcher.DispatchController | undefined
  #stopped: Error | undefined
  #body: AnswerBody | undefined
  #status = 0
  #settle: { resolve(a: UpstreamAnswer): void; reject(err: unknown): void } | undefined
  #closed = false

  constructor(call: UpstreamCall, sentAt: number, registry: Pick<TopologyRegistry, 'recordSuccess'>) {
    this.#call = call
    this.#sentAt = sentAt
    this.#registry = registry
    if (call.signal.aborted) this.#stopped = reasonOf(call.signal)
    else call.signal.addEventListener('abort', this.#onAbort)
    if (call.deadlineMs !== undefined) {
      this.#timer = setTimeout(() => this.#stop(new DeadlinePassed()), call.deadlineMs)
      this.#timer.unref()
    }
  }

  get stopped(): boolean {
    return this.#stopped !== undefined
  }

  dispatch(dispatcher: Dispatcher, options: Dispatcher.DispatchOptions): Promise<UpstreamAnswer> {
    return new Promise((resolve, reject) => {
      if (this.#stopped) return reject(this.#stopped)
      this.#settle = { resolve, reject }
      this.#controller = undefined
      dispatcher.dispatch(options, this)
    })
  }

  onRequestStart(controller: Dispatcher.DispatchController): void {
    this.#controller = controller
    if (this.#stopped) controller.abort(this.#stopped)
  }

  onResponseStart(controller: Dispatcher.DispatchController, statusCode: number, headers: IncomingHttpHeaders): void {
    if (statusCode < 200) return
    this.#status = statusCode
    this.#body = new AnswerBody(() => controller.resume())
    this.#settle?.resolve({ statusCode, headers, body: this.#body, sentAt: this.#sentAt })
    this.#settle = undefined
  }

  onResponseData(controller: Dispatcher.DispatchController, chunk: Buffer): void {
    if (this.#body && !this.#body.push(chunk)) controller.pause()
  }

  onResponseEnd(): void {
    this.#body?.end()
    this.close()
    this.#registry.recordSuccess(this.#call.target.id, this.#status)
  }

  onResponseError(_controller: Dispatcher.DispatchController, err: Error): void {
    if (this.#body) {
      this.#body.fail(this.#stopped ?? err)
      this.close()
      return
    }
    // Before an answer: the caller may try once more (send), so the call stays open.
    this.#settle?.reject(this.#stopped ?? err)
    this.#settle = undefined
  }

  close(): void {
    if (this.#closed) return
    this.#closed = true
    if (this.#timer) clearTimeout(this.#timer)
    this.#call.signal.removeEventListener('abort', this.#onAbort)
  }

  readonly #onAbort = (): void => this.#stop(reasonOf(this.#call.signal))

  #stop(reason: Error): void {
    if (this.#stopped || this.#closed) return
    this.#stopped = reason
    if (this.#controller) this.#controller.abort(reason)
    else {
      // Still waiting for a connection: the caller hears now; undici drops the request when
      // it reaches a socket (onRequestStart).
      this.#settle?.reject(reason)
      this.#settle = undefined
    }
  }
}

function reasonOf(signal: AbortSignal): Error {
  return signal.reason instanceof Error ? signal.reason : new ClientGone()
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
