import type { Clock } from '../../../common/clock.js'
import type { Random } from '../../../common/random.js'
import { isCompleteHandoff } from '../../../schemas/kv-transfer-params.js'
import type { Admission } from '../admission/admission.js'
import { RTR_ERR_LATE_READ, RTR_ERR_LEASE_LAPSED } from '../errors.js'
import type { PrefixRouting, RoutingNote } from '../routing/prefix-routing.js'
import { generatedTokens, maxTokensOf, type DecodePace } from '../leases/decode-pace.js'
import type { RouterMetrics } from '../metrics.js'
import type { TopologyRegistry } from '../topology/registry.js'
import type { InstanceView } from '../topology/views.js'
import type { Route } from '../topology/selection.js'
import type { Exchange, Handoff, PrefillSent } from './exchange.js'
import { decodeView, isChatPath, prefillView, streamedDecodeView } from './legs.js'
import { prefillFacts, type PrefillFacts } from './prefill-facts.js'
import type { BodyView } from './shared-body.js'
import { LegFailure, type Upstream, type UpstreamAnswer, type UpstreamCall } from './upstream.js'

export interface HandoffTimeouts {
  prefillMs: number
  decodeHeadersMs: number
  generationMs: number
  idleMs: number
}

export interface HandoffDeps {
  admission: Admission
  upstream: Upstream
  registry: TopologyRegistry
  metrics: RouterMetrics
  clock: Clock
  random: Random
  timeouts: HandoffTimeouts
  /** A lease that lapsed before the decode leg: prefill once more, or fail the request. */
  onLapsed: 'reprefill' | 'fail'
  /** Pair circuit breakers, fed by the decode leg's answer (a KV-load failure is D's 5xx). */
  pairs?: { recordFailure(prefill: string, decode: string): void; recordSuccess(prefill: string, decode: string): void }
  upstreamApiKey?: string
  /** A prefill answer named this engine_id (RouterEvents.engineAnswered: a gone one lives again). */
  engineAnswered?: (engineId: string) => void
  /**
   * Decoders' pace (leases.proveByWholeAnswer): a checked read of a non-streamed request may be
   * proven by D's whole answer instead of a streamed leg. Absent: always streamed.
   */
  pace?: DecodePace
  /** Prefix-aware selection (routing/prefix-routing.ts); absent: load alone. */
  prefix?: PrefixRouting
}

type Body = Record<string, unknown>

/**
 * What the client gets for one handoff: D's answer as it comes, or an engine's own 4xx.
 * `pairVerdict`: a streamed P/D answer's status says nothing of D's KV load (vLLM sends 200
 * first, then an error event if the load failed), so its first frame judges the pair.
 */
export type Answer =
  | {
      kind: 'upstream'
      handoff: Handoff
      call: UpstreamCall
      answer: UpstreamAnswer
      pairVerdict?: (ok: boolean) => void
      fromPrefill?: PrefillFacts
      /** D streams an answer the client wants whole (streamedDecodeView): the router assembles it. */
      assemble?: true
      /** D's whole answer, already read: it came within the read window, which proved the read. */
      whole?: WholeAnswer
    }
  | { kind: 'engine-error'; handoff: Handoff; status: number; contentType: string; body: Buffer }

type PdRoute = Route & { mode: 'pd' }
/** P's answer: its params (none when it could not hold the blocks) and when that leg was sent, or its own 4xx. */
type Prefilled = { params: Body | undefined; facts?: PrefillFacts | undefined; sent: PrefillSent } | { status: number; contentType: string; body: Buffer }

/**
 * How a decode leg is sent to one decoder, decided for the decoder that reads (again on a
 * redirect): as the client asked, streamed so the router sees D's first token (`assemble`),
 * or whole with a deadline that its arrival proves the read by (`proveWhole`).
 */
interface DecodeLeg {
  view: BodyView
  assemble: boolean
  proveWhole: boolean
}

const JSON_TYPE = 'application/json'

/** D's whole answer as read, and parsed (undefined when it is not JSON: passed on as it came). */
export interface WholeAnswer {
  text: Buffer
  json: unknown
}

/** A whole answer as read: parsed once, for whoever needs its members. */
export function wholeAnswer(text: Buffer): WholeAnswer {
  try {
    return { text, json: JSON.parse(text.toString('utf8')) }
  } catch {
    return { text, json: undefined }
  }
}

/** D's whole answer did not come within the read window: nothing proves its read was in time. */
class UnprovenRead extends Error {
  /** How long the leg had been out when it was given up: a lower bound on its time. */
  constructor(readonly ms: number) {
    super('no whole answer within the read window')
  }
}

/** A proven leg's deadline: past it the leg stops with UnprovenRead. */
function withDeadline(ms: number): Pick<UpstreamCall, 'deadlineMs' | 'deadlineError'> {
  return { deadlineMs: ms, deadlineError: () => new UnprovenRead(ms) }
}

/**
 * One prompt's way through the cluster (DESIGN "One request, end to end", steps 2–6):
 * admission to a pair, the prefill leg, the lease, the decode leg up to D's response head.
 * A refused connection is retried once elsewhere, on either leg, since the engine never saw
 * the request; nothing else is retried.
 */
export class HandoffRunner {
  readonly #d: HandoffDeps

  constructor(deps: HandoffDeps) {
    this.#d = deps
  }

  async run(ex: Exchange, body: BodyView, path: string): Promise<Answer> {
    const model = body.get('model') as string
    const h = ex.handoff(this.#newId())
    const note: RoutingNote = { tokens: 0, legs: {} }
    const prefix = await this.#d.prefix?.preference(isChatPath(path), (k) => body.get(k), ex.signal, note)
    const route = await this.#d.admission.admit({ model, signal: ex.signal, onMode: (m) => (ex.mode = m), ...(prefix ? { prefix } : {}) })
    ex.routed(route, prefix ? note : undefined)
    ex.hold(route)
    if (route.mode === 'single') {
      const leg: DecodeLeg = { view: decodeView(body, undefined), assemble: false, proveWhole: false }
      return (await this.#decode(ex, h, route, route.target, path, this.#headers(ex, h), () => leg))[0]
    }
    return this.#pd(ex, h, route, body, path, this.#d.onLapsed === 'reprefill')
  }

  /**
   * Prefill, lease, decode. A lease already too close to expiry when D would get it is never
   * dispatched (DESIGN step 5): by policy it is prefilled once more on a fresh pair, under a
   * new engine request id and a new lease, or the request fails with RTR_ERR_LEASE_LAPSED.
   */
  async #pd(ex: Exchange, h: Handoff, route: PdRoute, body: BodyView, path: string, mayReprefill: boolean): Promise<Answer> {
    const { clock, metrics } = this.#d
    const headers = this.#headers(ex, h)
    const started = clock.monotonic()
    const [pd, prefilled] = await this.#prefillWithRetry(ex, h, route, body, path, headers)
    const prefillDone = clock.monotonic()
    metrics.prefillDuration.observe((prefillDone - started) / 1000)
    // The lease is recorded before P's slot goes back: a drain waiting on P sees the slot or
    // the unread lease, never neither.
    if (!('status' in prefilled) && prefilled.params) h.issue(prefilled.params, pd.prefill.id, pd.decode.id, prefilled.sent)
    ex.release(pd.prefill.id)
    if ('status' in prefilled) return { kind: 'engine-error', handoff: h, ...prefilled }
    if (h.lapsed()) {
      const where = `handoff ${h.engineRequestId} prefilled on ${pd.prefill.id}`
      if (!mayReprefill) throw new RTR_ERR_LEASE_LAPSED(where)
      const again = this.#d.admission.retryRoute(body.get('model') as string, new Set(), 'pd')
      if (!again) throw new RTR_ERR_LEASE_LAPSED(`${where}; no prefiller is free to prefill again`)
      ex.hold(again)
      ex.release(pd.decode.id)
      ex.log.warn({ handoff: h.engineRequestId, prefill: pd.prefill.id }, 'lease lapsed before the decode leg; prefilling again')
      return this.#pd(ex, ex.handoff(this.#newId()), again, body, path, false)
    }
    const view = decodeView(body, prefilled.params)
    let answer: Answer
    try {
      const [decoded, leg] = await this.#decode(ex, h, pd, pd.decode, path, headers, (d) => this.#decodeLeg(body, view, h, d, mayReprefill))
      answer = decoded
      if (leg.proveWhole && answer.kind === 'upstream' && answer.answer.statusCode < 400) answer.whole = await this.#whole(h, answer)
    } catch (err) {
      if (!(err instanceof UnprovenRead)) throw err
      metrics.unprovenReads.inc()
      const d = h.decode
      // Its pace learns from the leg it never saw end (decode-pace.ts).
      const bound = maxTokensOf((m) => body.get(m))
      if (bound !== undefined) this.#d.pace?.tooSlow(d, err.ms, bound)
      const where = `handoff ${h.engineRequestId}: ${d}'s whole answer did not come within the read window`
      const again = this.#d.admission.retryRoute(body.get('model') as string, new Set(), 'pd')
      if (!again) throw new RTR_ERR_LATE_READ(d, `${where}; no prefiller is free to prefill again`)
      ex.hold(again)
      ex.release(d)
      ex.log.warn({ handoff: h.engineRequestId, decode: d }, "D's whole answer did not come within the read window; prefilling again, with a streamed decode leg")
      return this.#pd(ex, ex.handoff(this.#newId()), again, body, path, false)
    }
    if (prefilled.facts && answer.kind === 'upstream') answer.fromPrefill = prefilled.facts
    metrics.handoffGap.observe((clock.monotonic() - prefillDone) / 1000)
    const pairs = this.#d.pairs
    if (prefilled.params && answer.kind === 'upstream' && pairs) {
      // vLLM answers a failed KV load with 500 (kv_load_failure_policy=fail), or, streamed,
      // with 200 and then an error event; such failures are often the pair's, not either engine's.
      const [p, d] = [pd.prefill.id, answer.call.target.id]
      const { statusCode, headers: head } = answer.answer
      if (statusCode >= 500) pairs.recordFailure(p, d)
      else if (statusCode < 400 && String(head['content-type'] ?? '').startsWith('text/event-stream')) {
        answer.pairVerdict = (ok) => (ok ? pairs.recordSuccess(p, d) : pairs.recordFailure(p, d))
      } else if (statusCode < 400) pairs.recordSuccess(p, d)
    }
    return answer
  }

  /**
   * The decode leg for decoder `d`, once `h` checks reads as `d`'s (Handoff.issue, redirect).
   * The router judges a checked read (leases.readCheck router) by D's first token: a
   * non-streamed request's leg is streamed from D, and assembled. Or, when D's pace says the
   * answer ends well within the read window, by the whole answer (decode-pace.ts): its arrival
   * in time proves the read was. Past the window that proves nothing, and the prompt is
   * prefilled once more, with a streamed leg.
   */
  #decodeLeg(body: BodyView, view: BodyView, h: Handoff, d: string, mayReprefill: boolean): DecodeLeg {
    const checkedWhole = h.readChecked && body.get('stream') !== true
    const proveWhole = checkedWhole && mayReprefill && this.#provableWhole(body, d, h)
    const assemble = checkedWhole && !proveWhole
    return { view: assemble ? streamedDecodeView(view) : view, assemble, proveWhole }
  }

  /** Whether D's whole answer is expected well within the read window (and the request suits it). */
  #provableWhole(body: BodyView, decode: string, h: Handoff): boolean {
    const pace = this.#d.pace
    // Prompt logprobs (prompt_logprobs, or echo's) are P's: the streamed leg's merge of P's facts is the tried one.
    if (!pace || body.get('prompt_logprobs') != null || body.get('echo') === true) return false
    return pace.fits(decode, maxTokensOf((m) => body.get(m)), h.readWindowLeft())
  }

  /** D's whole answer, read here: proven by its arrival within the read window (Handoff.wholeAnswer), or UnprovenRead. */
  async #whole(h: Handoff, a: Answer & { kind: 'upstream' }): Promise<WholeAnswer> {
    const text = await this.#d.upstream.readAll(a.call, a.answer)
    if (!h.wholeAnswer()) throw new UnprovenRead(performance.now() - a.answer.sentAt)
    this.#d.metrics.wholeAnswerReads.inc()
    const whole = wholeAnswer(text)
    this.pace(a, whole.json)
    return whole
  }

  /** A decode leg's whole time over the tokens it generated, for D's pace (decode-pace.ts). */
  pace(a: Answer & { kind: 'upstream' }, answer: unknown): void {
    const tokens = generatedTokens(answer)
    if (tokens !== undefined) this.#d.pace?.observe(a.call.target.id, performance.now() - a.answer.sentAt, tokens)
  }

  #newId(): string {
    return `hnd-${this.#d.random.hex(12)}`
  }

  #headers(ex: Exchange, h: Handoff): Record<string, string> {
    const headers: Record<string, string> = { ...ex.forwarded, 'content-type': JSON_TYPE, 'x-request-id': h.engineRequestId }
    if (this.#d.upstreamApiKey) headers.authorization = `Bearer ${this.#d.upstreamApiKey}`
    return headers
  }

  /**
   * The decode leg (or the one leg of a single route) up to D's response head, and how it was
   * sent (`legFor`, asked for the decoder that gets it: the first, or the one it is redirected
   * to once the first refused the connection).
   */
  async #decode(
    ex: Exchange,
    h: Handoff,
    route: Route,
    d: InstanceView,
    path: string,
    headers: Record<string, string>,
    legFor: (decode: string) => DecodeLeg,
  ): Promise<[Answer, DecodeLeg]> {
    const call = (target: InstanceView, leg: DecodeLeg): UpstreamCall => ({
      target,
      leg: route.mode === 'pd' ? 'decode' : 'single',
      path,
      payload: leg.view.payload(),
      headers,
      signal: ex.signal,
      // A non-streamed answer's head comes only when generation ends.
      headersTimeoutMs: leg.view.get('stream') === true ? this.#d.timeouts.decodeHeadersMs : this.#d.timeouts.generationMs,
      bodyTimeoutMs: this.#d.timeouts.idleMs,
      ...(leg.proveWhole ? withDeadline(Math.max(0, h.readWindowLeft())) : {}),
    })
    let leg = legFor(d.id)
    let c = call(d, leg)
    let answer: UpstreamAnswer
    h.reading()
    try {
      answer = await this.#d.upstream.send(c)
    } catch (err) {
      // D refused the connection: it never saw P's params, so another decoder may use them.
      const refused = err instanceof LegFailure && err.retryable
      if (refused) h.refused()
      const other = refused ? this.#otherDecoder(ex, route, leg.view.get('model') as string, d) : undefined
      if (!other) throw this.#decodeFailed(h, err)
      ex.release(d.id)
      if (h.lapsed()) throw new RTR_ERR_LEASE_LAPSED(`handoff ${h.engineRequestId}: ${d.id} refused the connection and the lease ran out`)
      h.redirect(other.id)
      leg = legFor(other.id)
      c = call(other, leg)
      h.reading()
      answer = await this.#d.upstream.send(c).catch((e: unknown) => {
        if (e instanceof LegFailure && e.retryable) h.refused()
        return Promise.reject(this.#decodeFailed(h, e))
      })
    }
    return [{ kind: 'upstream', handoff: h, call: c, answer, ...(leg.assemble ? { assemble: true } : {}) }, leg]
  }

  /** The prefill leg; a refused connection moves the request once to another pair. */
  async #prefillWithRetry(
    ex: Exchange,
    h: Handoff,
    route: PdRoute,
    body: BodyView,
    path: string,
    headers: Record<string, string>,
  ): Promise<[PdRoute, Prefilled]> {
    try {
      return [route, await this.#prefill(ex, h, route.prefill, body, path, headers)]
    } catch (err) {
      if (!(err instanceof LegFailure) || !err.retryable) throw err
      const other = this.#d.admission.retryRoute(body.get('model') as string, new Set([route.prefill.id]), 'pd')
      if (!other) throw err
      ex.hold(other)
      ex.release(route.prefill.id)
      ex.release(route.decode.id)
      return [other, await this.#prefill(ex, h, other.prefill, body, path, headers)]
    }
  }

  /** One prefill call: P's params (undefined when it could not hold the blocks), or its own 4xx. */
  async #prefill(ex: Exchange, h: Handoff, p: InstanceView, body: BodyView, path: string, headers: Record<string, string>): Promise<Prefilled> {
    const { upstream, metrics, registry } = this.#d
    const call: UpstreamCall = {
      target: p,
      leg: 'prefill',
      path,
      payload: prefillView(body).payload(),
      headers,
      signal: ex.signal,
      headersTimeoutMs: this.#d.timeouts.prefillMs,
      bodyTimeoutMs: this.#d.timeouts.prefillMs,
      // One deadline for P's whole answer, head and body together.
      deadlineMs: this.#d.timeouts.prefillMs,
    }
    // Before the send, so P cannot have started its lease earlier (PrefillSent).
    const sent: PrefillSent = { monotonic: this.#d.clock.monotonic(), wall: this.#d.clock.now() }
    const answer = await upstream.send(call)
    const text = await upstream.readAll(call, answer)
    const status = answer.statusCode
    if (status < 400) upstream.firstToken(call, answer)
    if (status >= 500) throw upstream.statusFailure(call, status, text)
    if (status >= 400) return { status, contentType: String(answer.headers['content-type'] ?? JSON_TYPE), body: text }
    let parsed: unknown
    try {
      parsed = JSON.parse(text.toString('utf8'))
    } catch (err) {
      throw upstream.fail(call, { kind: 'bad-response', detail: 'answer is not JSON', cause: err })
    }
    const params = (parsed as { kv_transfer_params?: unknown } | null)?.kv_transfer_params
    if (!isCompleteHandoff(params)) {
      // vLLM answers without params when it could not hold the blocks; D then prefills itself.
      metrics.handoffsWithoutParams.inc()
      ex.log.debug({ handoff: h.engineRequestId }, 'prefill answer without usable kv_transfer_params')
      return { params: undefined, sent }
    }
    // A new engine_id at a known address: the registry tells its subscribers the old one is gone.
    registry.observeEngineId(p.id, String(params.remote_engine_id))
    this.#d.engineAnswered?.(String(params.remote_engine_id))
    return { params: params as Body, facts: prefillFacts(parsed, isChatPath(path)), sent }
  }

  #otherDecoder(ex: Exchange, route: Route, model: string, failed: InstanceView): InstanceView | undefined {
    const exclude = new Set([failed.id])
    if (route.mode === 'pd') {
      const d = this.#d.admission.retryDecoder(route.prefill, model, exclude)
      if (d) ex.holdInstance(d.id)
      return d
    }
    const other = this.#d.admission.retryRoute(model, exclude, 'single')
    if (other) ex.hold(other)
    return other?.target
  }

  #decodeFailed(h: Handoff, err: unknown): unknown {
    if (err instanceof LegFailure) h.decodeFailed()
    return err
  }
}
