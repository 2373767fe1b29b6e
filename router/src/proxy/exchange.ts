import type { FastifyBaseLogger, FastifyReply } from 'fastify'
import type { Logger } from 'pino'
import type { Clock } from '../../../common/clock.js'
import type { RouterErrorCode } from '../errors.js'
import type { LeaseEndReason, LeaseLedger } from '../leases/ledger.js'
import type { RouterMetrics } from '../metrics.js'
import type { RoutingNote } from '../routing/prefix-routing.js'
import type { TopologyRegistry } from '../topology/registry.js'
import type { Route } from '../topology/selection.js'

/**
 * How a request ended: `ok`, the client left, an engine's own 4xx (`http_404`), a stream that
 * carried the engine's own error event (its status, 200, was sent before it failed), or a router code.
 */
export type Outcome = 'ok' | 'client_gone' | `http_${number}` | 'engine_error_event' | RouterErrorCode

export interface ExchangeDeps {
  registry: TopologyRegistry
  ledger: LeaseLedger
  metrics: RouterMetrics
  clock: Clock
  /**
   * leases.readCheck: for a decoder whose reads the router checks, how soon after the prefill
   * leg was sent D's first token must come (the lease minus the margin), or the answer is
   * withheld; undefined for a decoder that checks its own reads. Absent: none is checked.
   */
  readWithinMs?: (decode: string) => number | undefined
}

/**
 * When the prefill leg that P answered was sent, on both clocks: the origin of the lease's
 * window. P starts its lease when it finishes the request, so never before this; whatever
 * delays P's answer on its way back (a router pause, a slow hop, an API server behind its
 * engine core) cannot lengthen the window past P's real expiry (DESIGN "When the router's own
 * window starts", issue 37).
 */
export interface PrefillSent {
  /** clock.monotonic() ms: the read window's origin. */
  monotonic: number
  /** clock.now() ms: the ledger's issuedAt, shared with other routers. */
  wall: number
}

type LeaseState = 'none' | 'issued' | 'reading' | 'done' | 'ended'

/**
 * One prompt's handoff inside an exchange: its own engine request id (fresh, so a client
 * retry that reuses its X-Request-Id never collides inside an engine) and its lease. The ledger
 * is told each transition here and nowhere else. `issued` means D has not been sent the
 * params (or refused the connection); from `reading` on, only D's first byte ends the lease
 * here: a settle without it leaves the lease to P (ledger.ts, "who may end a lease early").
 */
export class Handoff {
  readonly engineRequestId: string
  #lease: LeaseState = 'none'
  #failedLeg: 'decode' | undefined
  /** When the prefill leg P answered was sent (monotonic ms): the read window's origin. */
  #origin = 0
  #decode = ''
  /** Monotonic ms by which D's first token must come (readWithinMs after #origin), for the decoder that reads. */
  #readBy = Infinity
  readonly #ex: Exchange

  constructor(ex: Exchange, engineRequestId: string) {
    this.#ex = ex
    this.engineRequestId = engineRequestId
  }

  /** P answered with kv_transfer_params: its blocks are pinned for this handoff since at most `sent`. */
  issue(params: Record<string, unknown>, prefill: string, decode: string, sent: PrefillSent): void {
    this.#lease = 'issued'
    this.#origin = sent.monotonic
    this.#checkReadsOf(decode)
    const remote = params.remote_request_id
    this.#ex.deps.ledger.issue({
      requestId: this.engineRequestId,
      clientRequestId: this.#ex.id,
      prefill,
      decode,
      engineId: String(params.remote_engine_id),
      // vLLM before late 2025 sends no remote_request_id (PR #29665).
      ...(typeof remote === 'string' ? { remoteRequestId: remote } : {}),
      issuedAt: sent.wall,
    })
  }

  /** The read check is the reading decoder's: a stock one is checked, one with a transfer agent checks itself. */
  #checkReadsOf(decode: string): void {
    this.#decode = decode
    const within = this.#ex.deps.readWithinMs?.(decode)
    this.#readBy = within === undefined ? Infinity : this.#origin + within
  }

  /** The decoder the params go to (the first pick, or the one it was redirected to). */
  get decode(): string {
    return this.#decode
  }

  /** Whether the router judges D's read by when its first token comes (firstToken, or wholeAnswer). */
  get readChecked(): boolean {
    return this.#readBy !== Infinity
  }

  /** Milliseconds left until the read deadline (Infinity when the router checks no read). */
  readWindowLeft(): number {
    return this.#readBy - this.#ex.deps.clock.monotonic()
  }

  /**
   * The params go to another decoder after the first refused the connection. Its read is
   * checked as its own (a stock decoder behind one with an agent is checked, and the other way
   * round), in the same window: P's lease did not start again.
   */
  redirect(decode: string): void {
    if (this.#lease !== 'issued') return
    this.#checkReadsOf(decode)
    this.#ex.deps.ledger.redirect(this.engineRequestId, decode)
  }

  /**
   * Before the decode leg: whether the lease is too close to expiry to send D its params.
   * A lapsed lease is over (the ledger released it to P); the caller re-prefills or fails.
   */
  lapsed(): boolean {
    if (this.#lease !== 'issued' || !this.#ex.deps.ledger.lapsed(this.engineRequestId)) return false
    this.#lease = 'ended'
    return true
  }

  /** The decode leg is being sent with the params (before D answers: it reads first). */
  reading(): void {
    if (this.#lease !== 'issued') return
    this.#lease = 'reading'
    this.#ex.deps.ledger.reading(this.engineRequestId)
  }

  /** D refused the connection: it never saw the params, so the lease is undispatched again. */
  refused(): void {
    if (this.#lease !== 'reading') return
    this.#lease = 'issued'
    this.#ex.deps.ledger.refused(this.engineRequestId)
  }

  /** D's answer began (its first frame, or a whole non-streamed answer): the read is done. */
  done(): void {
    if (this.#lease !== 'issued' && this.#lease !== 'reading') return
    this.#lease = 'done'
    this.#ex.deps.ledger.done(this.engineRequestId)
  }

  /**
   * D's first token (or its whole answer) came: the read is done. False when it came past
   * the read deadline (leases.readCheck `router`): P may have reaped the blocks and reused
   * them before D read them, and a stock vLLM decoder does not check, so the answer must not
   * reach the client.
   */
  firstToken(): boolean {
    const reading = this.#lease === 'issued' || this.#lease === 'reading'
    this.done()
    if (!reading || this.#ex.deps.clock.monotonic() < this.#readBy) return true
    this.#ex.deps.metrics.lateReads.inc()
    return false
  }

  /**
   * D's whole answer has come (a non-streamed decode leg): the read is done. True when it came
   * before the read deadline, which proves the read did too; false when it did not, which
   * proves nothing either way (not a late read: the runner prefills again, handoff.ts).
   */
  wholeAnswer(): boolean {
    this.done()
    return this.#ex.deps.clock.monotonic() < this.#readBy
  }

  decodeFailed(): void {
    this.#failedLeg = 'decode'
  }

  /**
   * At settle: a lease still unread ends here. Never dispatched: released, so P's blocks are
   * not stranded until expiry. Dispatched: abandoned to P, never released (D may be reading).
   */
  end(outcome: Outcome): void {
    if (this.#lease !== 'issued' && this.#lease !== 'reading') return
    this.#lease = 'ended'
    const reason: LeaseEndReason = outcome === 'client_gone' ? 'client_gone' : this.#failedLeg === 'decode' ? 'decode_failed' : 'router_error'
    this.#ex.deps.ledger.release(this.engineRequestId, reason)
  }
}

/**
 * One client request, from arrival to the last byte (DESIGN "One request, end to end"). It
 * owns the abort signal for every upstream leg, the instance slots held for it, its handoffs
 * and its timings, and settles exactly once when the client connection closes for it,
 * whatever path got there: counted in metrics, slots released, unread leases released.
 */
export class Exchange {
  /** The client's X-Request-Id (or one made for it): logs, the response header and the metrics exemplar; never sent to an engine. */
  readonly id: string
  readonly signal: AbortSignal
  readonly started: number
  readonly log: FastifyBaseLogger
  readonly deps: ExchangeDeps
  mode: Route['mode'] | 'none' = 'none'
  readonly #handoffs: Handoff[] = []
  readonly #abort = new AbortController()
  readonly #held: string[] = []
  #outcome: Outcome | undefined
  #settled = false

  /** Client headers every leg carries (legs.ts FORWARDED_HEADERS). */
  readonly forwarded: Readonly<Record<string, string>>

  constructor(deps: ExchangeDeps, id: string, reply: FastifyReply, log: FastifyBaseLogger, forwarded: Record<string, string> = {}) {
    this.deps = deps
    this.id = id
    this.forwarded = forwarded
    this.log = log
    this.signal = this.#abort.signal
    this.started = deps.clock.monotonic()
    deps.metrics.inflight.inc()
    // 'close' fires once per response: after the last byte was flushed, or when the client
    // went away first. That makes it the one place every path ends.
    reply.raw.once('close', () => {
      const finished = reply.raw.writableFinished
      if (!finished) this.#abort.abort(new ClientGone())
      this.#settle(finished ? (this.#outcome ?? 'ok') : 'client_gone')
    })
  }

  handoff(engineRequestId: string): Handoff {
    const h = new Handoff(this, engineRequestId)
    this.#handoffs.push(h)
    return h
  }

  /**
   * The route chosen, and why where the prefix index had a say, bound to every later log line
   * of the request: the access log's "request completed" says where each request went.
   */
  routed(route: Route, why?: RoutingNote): void {
    const where = route.mode === 'pd' ? { mode: route.mode, prefill: route.prefill.id, decode: route.decode.id } : { mode: route.mode, instance: route.target.id }
    // Fastify's request logger is a pino child; its type does not say so.
    ;(this.log as FastifyBaseLogger & Partial<Pick<Logger, 'setBindings'>>).setBindings?.({ route: why ? { ...where, ...why } : where })
  }

  /** Slots acquired for this request; released at settle (or earlier with `release`). */
  hold(route: Route): void {
    const ids = route.mode === 'pd' ? [route.prefill.id, route.decode.id] : [route.target.id]
    for (const id of ids) this.holdInstance(id)
  }

  holdInstance(id: string): void {
    // A slot granted after the exchange ended goes straight back.
    if (this.#settled) this.deps.registry.release(id)
    else this.#held.push(id)
  }

  /** Gives one held slot back early (P's, once its leg is over). */
  release(id: string): void {
    const i = this.#held.indexOf(id)
    if (i < 0) return
    this.#held.splice(i, 1)
    this.deps.registry.release(id)
  }

  /** What the request's answer says happened, recorded when it is decided. */
  outcome(outcome: Outcome): void {
    this.#outcome ??= outcome
  }

  /** Aborts every upstream leg still running (one sub-request of a batch failed). */
  abortUpstream(reason: unknown): void {
    this.#abort.abort(reason)
  }

  #settle(outcome: Outcome): void {
    if (this.#settled) return
    this.#settled = true
    const { metrics, clock, registry } = this.deps
    if (outcome !== 'ok' && !this.signal.aborted) this.#abort.abort(new ClientGone())
    for (const id of this.#held.splice(0)) registry.release(id)
    for (const h of this.#handoffs) h.end(outcome)
    metrics.inflight.dec()
    metrics.requests.inc({ mode: this.mode, outcome })
    metrics.requestDuration.observe({
      labels: { mode: this.mode },
      value: (clock.monotonic() - this.started) / 1000,
      // OpenMetrics allows 128 characters of exemplar labels in all. (prom-client's types
      // wrongly tie exemplar label names to the metric's own label names.)
      exemplarLabels: { request_id: this.id.slice(0, 100) } as Record<string, string> as { mode: string },
    })
    if (outcome === 'client_gone') this.log.info('client went away; upstream work aborted')
  }
}

/** The reason an exchange's signal carries when the client left (nothing is sent back). */
export class ClientGone extends Error {
  constructor() {
    super('the client went away')
  }
}
