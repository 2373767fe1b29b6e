import { Readable } from 'node:stream'
import type { FastifyReply, FastifyRequest } from 'fastify'
import { request, type Dispatcher } from 'undici'
import type { Clock } from '../../../common/clock.js'
import type { Random } from '../../../common/random.js'
import { isCompleteHandoff } from '../../../schemas/kv-transfer-params.js'
import { errorEvent, RTR_ERR_MODEL_NOT_FOUND, RTR_ERR_NO_INSTANCE, type CodedError, type RouterErrorCode } from '../errors.js'
import type { LeaseLedger } from '../leases/ledger.js'
import type { RouterMetrics } from '../metrics.js'
import type { InstanceView, TopologyRegistry } from '../topology/registry.js'
import { selectRoute, type PairingPolicy } from '../topology/selection.js'
import { decodeBody, prefillBody, wantsStream } from './legs.js'
import { countsAgainstInstance, mapUpstreamFailure, upstreamErrorDetail, type Leg, type UpstreamFailure } from './upstream-errors.js'

export interface HandoffTimeouts {
  prefillMs: number
  decodeHeadersMs: number
  idleMs: number
}

export interface HandoffDeps {
  registry: TopologyRegistry
  dispatcher: Dispatcher
  ledger: LeaseLedger
  metrics: RouterMetrics
  clock: Clock
  random: Random
  pairing: PairingPolicy
  timeouts: HandoffTimeouts
  upstreamApiKey?: string
}

type Body = Record<string, unknown>

/** Thrown inside a leg when the client went away; nothing is sent back. */
class ClientGone extends Error {}

/** A failure already mapped to a router error, carrying the leg for metrics. */
class LegFailure extends Error {
  constructor(
    readonly leg: Leg,
    readonly error: CodedError & { code: RouterErrorCode },
  ) {
    super(error.message)
  }
}

/** An engine's own 4xx answer (bad prompt, unknown model): relayed to the client as it is. */
interface EngineClientError {
  status: number
  contentType: string
  body: Buffer
}

type PrefillOutcome = { params: Body | undefined } | { clientError: EngineClientError }

const JSON_TYPE = 'application/json'

/**
 * The two-leg P/D flow (docs/architecture.md "One request"): pick a pair, prefill on P,
 * hand P's kv_transfer_params to D verbatim, relay D's answer. One instance per router.
 */
export class HandoffProxy {
  readonly #d: HandoffDeps

  constructor(deps: HandoffDeps) {
    this.#d = deps
  }

  async handle(req: FastifyRequest, reply: FastifyReply, path: string): Promise<FastifyReply> {
    const { registry, metrics, clock } = this.#d
    const body = req.body as Body
    const model = body.model as string
    const snapshot = registry.snapshot()
    if (snapshot.models.size > 0 && !snapshot.models.has(model)) throw new RTR_ERR_MODEL_NOT_FOUND(model)
    const route = selectRoute(snapshot, model, this.#d.pairing, this.#d.random)
    if (!route) throw new RTR_ERR_NO_INSTANCE(model)

    // One controller per request: a client disconnect aborts whichever leg is in flight.
    const abort = new AbortController()
    reply.raw.once('close', () => {
      if (!reply.raw.writableFinished) abort.abort()
    })
    const headers: Record<string, string> = { 'content-type': JSON_TYPE, 'x-request-id': req.id }
    if (this.#d.upstreamApiKey) headers.authorization = `Bearer ${this.#d.upstreamApiKey}`
    const started = clock.monotonic()
    metrics.inflight.inc()
    let outcome = 'ok'
    // A streamed answer outlives this function: its relay reports the outcome when it ends.
    const finish = (result: string): void => {
      metrics.requests.inc({ mode: route.mode, outcome: result })
      metrics.requestDuration.observe({ mode: route.mode }, (clock.monotonic() - started) / 1000)
    }
    let streaming = false
    try {
      let decoder: InstanceView
      let params: Body | undefined
      let prefillDone = started
      if (route.mode === 'pd') {
        const res = await this.#prefill(route.prefill, path, body, headers, abort.signal)
        prefillDone = clock.monotonic()
        metrics.prefillDuration.observe((prefillDone - started) / 1000)
        if ('clientError' in res) {
          outcome = `http_${res.clientError.status}`
          return reply.code(res.clientError.status).type(res.clientError.contentType).send(res.clientError.body)
        }
        params = res.params
        decoder = route.decode
        if (params) {
          this.#d.ledger.issue({
            requestId: req.id,
            prefill: route.prefill.id,
            decode: decoder.id,
            engineId: String(params.remote_engine_id),
            remoteRequestId: String(params.remote_request_id),
            issuedAt: clock.now(),
          })
        }
      } else {
        decoder = route.target
      }
      if (abort.signal.aborted) throw new ClientGone()
      const onFirstByte = (): void => {
        if (route.mode === 'pd') metrics.handoffGap.observe((clock.monotonic() - prefillDone) / 1000)
      }
      const sent = await this.#decode(req, reply, decoder, path, decodeBody(body, params), headers, abort.signal, onFirstByte, finish)
      streaming = sent.streaming
      return sent.reply
    } catch (err) {
      if (err instanceof ClientGone || abort.signal.aborted) {
        outcome = 'client_gone'
        this.#d.ledger.release(req.id, 'client_gone')
        req.log.info('client went away; upstream work aborted')
        return reply.code(499).send()
      }
      if (err instanceof LegFailure) {
        outcome = err.error.code
        metrics.upstreamErrors.inc({ leg: err.leg, code: err.error.code })
        if (err.leg === 'decode') this.#d.ledger.release(req.id, 'decode_failed')
        throw err.error
      }
      outcome = 'RTR_ERR_INTERNAL'
      this.#d.ledger.release(req.id, 'router_error')
      throw err
    } finally {
      metrics.inflight.dec()
      if (!streaming) finish(outcome)
    }
  }

  async #prefill(p: InstanceView, path: string, body: Body, headers: Record<string, string>, signal: AbortSignal): Promise<PrefillOutcome> {
    const { registry, metrics } = this.#d
    registry.acquire(p.id)
    try {
      const res = await this.#send(p, 'prefill', path, JSON.stringify(prefillBody(body)), headers, signal, this.#d.timeouts.prefillMs, this.#d.timeouts.prefillMs)
      const text = await this.#readAll(p, 'prefill', res, signal)
      if (res.statusCode >= 400) return { clientError: this.#clientError(p, 'prefill', res, text) }
      let parsed: unknown
      try {
        parsed = JSON.parse(text.toString('utf8'))
      } catch (err) {
        throw this.#fail(p, 'prefill', { kind: 'bad-response', detail: 'answer is not JSON', cause: err })
      }
      registry.recordSuccess(p.id)
      const params = (parsed as { kv_transfer_params?: unknown } | null)?.kv_transfer_params
      if (!isCompleteHandoff(params)) {
        // vLLM answers without params when it could not hold the blocks; D then prefills itself.
        metrics.handoffsWithoutParams.inc()
        return { params: undefined }
      }
      const change = registry.observeEngineId(p.id, String(params.remote_engine_id))
      if (change) {
        // A new engine_id at a known address: the old incarnation is gone (peer_gone seam).
        metrics.upstreamErrors.inc({ leg: 'prefill', code: 'engine_id_changed' })
      }
      return { params: params as Body }
    } finally {
      registry.release(p.id)
    }
  }

  async #decode(
    req: FastifyRequest,
    reply: FastifyReply,
    d: InstanceView,
    path: string,
    body: Body,
    headers: Record<string, string>,
    signal: AbortSignal,
    onFirstByte: () => void,
    onStreamEnd: (outcome: string) => void,
  ): Promise<{ reply: FastifyReply; streaming: boolean }> {
    const { registry, ledger } = this.#d
    registry.acquire(d.id)
    let released = false
    const releaseOnce = (): void => {
      if (!released) {
        released = true
        registry.release(d.id)
      }
    }
    try {
      ledger.reading(req.id)
      const res = await this.#send(d, 'decode', path, JSON.stringify(body), headers, signal, this.#d.timeouts.decodeHeadersMs, this.#d.timeouts.idleMs)
      // D's response head is its first byte: the end of the handoff gap.
      onFirstByte()
      const contentType = String(res.headers['content-type'] ?? JSON_TYPE)
      reply.header('x-request-id', req.id)
      if (res.statusCode >= 400) {
        const text = await this.#readAll(d, 'decode', res, signal)
        const clientError = this.#clientError(d, 'decode', res, text)
        ledger.release(req.id, 'decode_failed')
        return { reply: reply.code(clientError.status).type(clientError.contentType).send(clientError.body), streaming: false }
      }
      if (!wantsStream(body) || !contentType.startsWith('text/event-stream')) {
        const buf = await this.#readAll(d, 'decode', res, signal)
        ledger.done(req.id)
        registry.recordSuccess(d.id)
        return { reply: reply.code(res.statusCode).type(contentType).send(buf), streaming: false }
      }
      // Streamed: relay chunk by chunk, no buffering. Past this point the status is sent, so
      // a failure can only end the stream with an error event.
      const relay = this.#relay(d, res.body, signal, () => ledger.done(req.id), (outcome) => {
        releaseOnce()
        if (outcome === 'ok') registry.recordSuccess(d.id)
        else if (outcome === 'client_gone') req.log.info('client went away; upstream work aborted')
        onStreamEnd(outcome)
      })
      released = true // the relay's end callback owns the release now
      reply.code(res.statusCode).header('content-type', contentType).header('cache-control', 'no-cache')
      return { reply: reply.send(Readable.from(relay, { objectMode: false })), streaming: true }
    } finally {
      if (!released) releaseOnce()
    }
  }

  async *#relay(d: InstanceView, body: Dispatcher.ResponseData['body'], signal: AbortSignal, onFirst: () => void, onEnd: (outcome: string) => void): AsyncGenerator<Buffer> {
    let first = true
    // Until the body ends cleanly, an early return (the client left) is the outcome.
    let outcome = 'client_gone'
    try {
      for await (const chunk of body as AsyncIterable<Buffer>) {
        if (first) {
          first = false
          onFirst()
        }
        yield chunk
      }
      outcome = 'ok'
    } catch (err) {
      if (signal.aborted) return
      const mapped = mapUpstreamFailure({ kind: 'transport', cause: err }, 'decode', d.id)
      outcome = mapped.code
      this.#d.metrics.upstreamErrors.inc({ leg: 'decode', code: mapped.code })
      if (countsAgainstInstance(mapped)) this.#d.registry.recordFailure(d.id)
      yield Buffer.from(errorEvent(mapped))
    } finally {
      if (outcome !== 'ok' && !body.destroyed) body.destroy()
      onEnd(outcome)
    }
  }

  async #send(
    inst: InstanceView,
    leg: Leg,
    path: string,
    payload: string,
    headers: Record<string, string>,
    signal: AbortSignal,
    headersTimeout: number,
    bodyTimeout: number,
  ): Promise<Dispatcher.ResponseData> {
    try {
      return await request(inst.url + path, {
        method: 'POST',
        body: payload,
        headers,
        signal,
        dispatcher: this.#d.dispatcher,
        headersTimeout,
        bodyTimeout,
      })
    } catch (err) {
      if (signal.aborted) throw new ClientGone()
      throw this.#fail(inst, leg, { kind: 'transport', cause: err })
    }
  }

  async #readAll(inst: InstanceView, leg: Leg, res: Dispatcher.ResponseData, signal: AbortSignal): Promise<Buffer> {
    try {
      return Buffer.from(await res.body.arrayBuffer())
    } catch (err) {
      if (signal.aborted) throw new ClientGone()
      throw this.#fail(inst, leg, { kind: 'transport', cause: err })
    }
  }

  /** 4xx: the engine rejected the request itself, so the client sees the engine's answer. 5xx: mapped. */
  #clientError(inst: InstanceView, leg: Leg, res: Dispatcher.ResponseData, body: Buffer): EngineClientError {
    if (res.statusCode >= 500) {
      throw this.#fail(inst, leg, { kind: 'status', status: res.statusCode, detail: upstreamErrorDetail(body.toString('utf8')) })
    }
    return { status: res.statusCode, contentType: String(res.headers['content-type'] ?? JSON_TYPE), body }
  }

  #fail(inst: InstanceView, leg: Leg, failure: UpstreamFailure): LegFailure {
    const error = mapUpstreamFailure(failure, leg, inst.id)
    if (countsAgainstInstance(error)) this.#d.registry.recordFailure(inst.id)
    return new LegFailure(leg, error)
  }
}
