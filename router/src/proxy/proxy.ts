import { Readable } from 'node:stream'
import type { FastifyReply, FastifyRequest } from 'fastify'
import { vllmRequestProblem } from '../../../common/vllm-request-rules.js'
import { errorEvent, isRouterError, RTR_ERR_INTERNAL, RTR_ERR_INVALID_REQUEST, RTR_ERR_LATE_READ, RTR_ERR_TOO_MANY_HANDOFFS, type CodedError, type RouterErrorCode } from '../errors.js'
import { assembleStream, StreamedError } from './assemble.js'
import { EngineErrorEvent, mergeCompletions, mergeStreams, SPLIT_MEMBERS, splitRequest, type SubRequest } from './batch.js'
import { ClientGone, Exchange, type ExchangeDeps } from './exchange.js'
import { HandoffRunner, wholeAnswer, type Answer, type HandoffDeps, type WholeAnswer } from './handoff.js'
import { forwardedHeaders, isChatPath, LEG_MEMBERS, wantsStream, withoutClientParams } from './legs.js'
import { SharedBody } from './shared-body.js'
import { relaySse, withUsageFacts } from './relay.js'
import { withPrefillFacts, type PrefillFacts } from './prefill-facts.js'
import { LegFailure, type Upstream } from './upstream.js'

type Body = Record<string, unknown>
type Mapped = CodedError & { code: RouterErrorCode }

const JSON_TYPE = 'application/json'

/** The members any leg may change: SharedBody serialises the rest once for all legs. */
const VOLATILE: ReadonlySet<string> = new Set([...LEG_MEMBERS, ...SPLIT_MEMBERS])

/** One sub-request of a batch failed: the others are stopped (their signal carries this). */
class BatchAborted extends Error {}

/**
 * The completion routes' handler: one request's story. An Exchange is opened for it and
 * settles once, when the response closes; a batch of prompts or n > 1 choices runs one
 * handoff per prompt and choice (batch.ts); the answer is relayed, and every failure becomes
 * an outcome here and a client error in app.ts's error handler.
 */
export class CompletionProxy {
  readonly #deps: ExchangeDeps & HandoffDeps & { maxHandoffsPerRequest: number }
  readonly #runner: HandoffRunner

  constructor(deps: ExchangeDeps & HandoffDeps & { maxHandoffsPerRequest: number }) {
    this.#deps = deps
    this.#runner = new HandoffRunner(deps)
  }

  async handle(req: FastifyRequest, reply: FastifyReply, path: string): Promise<FastifyReply> {
    const ex = new Exchange(this.#deps, req.id, reply, req.log, forwardedHeaders(req.headers))
    const body = req.body as Body
    try {
      // What D would refuse is refused before P spends a prefill and a lease on it.
      const problem = vllmRequestProblem(body, isChatPath(path))
      if (problem) throw new RTR_ERR_INVALID_REQUEST(problem.message)
      // Every leg of every handoff is a view of this one body, serialised once (shared-body.ts).
      const root = new SharedBody(withoutClientParams(body), VOLATILE).view()
      const subs = splitRequest(body, path, root)
      if (subs && subs.length > this.#deps.maxHandoffsPerRequest) throw new RTR_ERR_TOO_MANY_HANDOFFS(subs.length, this.#deps.maxHandoffsPerRequest)
      if (subs && subs.length > 1) return await this.#batch(ex, reply, body, subs, path)
      const answer = await this.#runner.run(ex, subs?.[0]?.view ?? root, path)
      return await this.#respond(ex, reply, answer, wantsStream(body))
    } catch (err) {
      return this.#failed(ex, reply, err)
    }
  }

  /** Relays one handoff's answer: an engine's 4xx as it is, a 5xx mapped, 2xx streamed or whole. */
  async #respond(ex: Exchange, reply: FastifyReply, a: Answer, stream: boolean): Promise<FastifyReply> {
    if (a.kind === 'engine-error') {
      ex.outcome(`http_${a.status}`)
      return reply.code(a.status).type(a.contentType).send(a.body)
    }
    const { upstream } = this.#deps
    const res = a.answer
    const contentType = String(res.headers['content-type'] ?? JSON_TYPE)
    if (res.statusCode >= 400) {
      a.handoff.decodeFailed()
      const text = await upstream.readAll(a.call, a.answer)
      if (res.statusCode >= 500) throw upstream.statusFailure(a.call, res.statusCode, text)
      ex.outcome(`http_${res.statusCode}`)
      return reply.code(res.statusCode).type(contentType).send(text)
    }
    if (a.assemble && contentType.startsWith('text/event-stream')) {
      return reply.code(res.statusCode).type(JSON_TYPE).send(JSON.stringify(await this.#assembled(a)))
    }
    if (a.whole) return reply.code(res.statusCode).type(contentType).send(withFacts(a.whole, a))
    if (!stream || !contentType.startsWith('text/event-stream')) {
      const buf = await upstream.readAll(a.call, a.answer)
      a.handoff.done()
      return reply.code(res.statusCode).type(contentType).send(a.fromPrefill ? withFacts(wholeAnswer(buf), a) : buf)
    }
    // Past this point the status is sent: a failure can only end the stream with an error event.
    const relay = relaySse(res.body, {
      signal: ex.signal,
      onFirstFrame: (kind) => firstFrame(upstream, a, kind),
      onEnd: (r) => {
        if (r === 'error_event') ex.outcome('engine_error_event')
        else if (r !== 'ok') ex.outcome(r.code)
      },
      mapError: (err) => upstream.fail(a.call, { kind: 'transport', cause: err }).error,
      ...(a.fromPrefill?.cachedTokens !== undefined ? { rewrite: (frames: Buffer) => withUsageFacts(frames, a.fromPrefill as PrefillFacts, isChat(a)) } : {}),
    })
    return reply.code(res.statusCode).header('content-type', contentType).header('cache-control', 'no-cache').send(relay)
  }

  /** D's streamed answer put together for a client that wants it whole (assemble.ts), with P's facts. */
  async #assembled(a: Answer & { kind: 'upstream' }): Promise<Body> {
    const { upstream } = this.#deps
    let answer: Body
    try {
      answer = await assembleStream(a.answer.body, isChat(a), (kind) => firstFrame(upstream, a, kind))
      this.#runner.pace(a, answer)
    } catch (err) {
      // The client left (the caller answers for that), or the first token came too late.
      if (a.call.signal.aborted || isRouterError(err)) throw err
      if (err instanceof StreamedError) throw upstream.statusFailure(a.call, 500, Buffer.from(err.event))
      if (err instanceof SyntaxError) throw upstream.fail(a.call, { kind: 'bad-response', detail: 'a stream frame is not JSON', cause: err })
      throw upstream.fail(a.call, { kind: 'transport', cause: err })
    }
    return a.fromPrefill ? withPrefillFacts(answer, a.fromPrefill, isChat(a)) : answer
  }

  async #batch(ex: Exchange, reply: FastifyReply, body: Body, subs: SubRequest[], path: string): Promise<FastifyReply> {
    const answers = await allOrStop(
      ex,
      subs.map((s) => this.#runner.run(ex, s.view, path)),
    )
    const bad = answers.find((a) => a.kind === 'engine-error' || a.answer.statusCode >= 400)
    if (bad) {
      // The first failed prompt answers for the batch; the other prompts' legs are stopped.
      try {
        return await this.#respond(ex, reply, bad, false)
      } finally {
        ex.abortUpstream(new BatchAborted())
      }
    }
    const ok = answers as (Answer & { kind: 'upstream' })[]
    const { upstream } = this.#deps
    if (!wantsStream(body)) {
      const parsed = await allOrStop(
        ex,
        ok.map(async (a) => {
          if (a.assemble) return this.#assembled(a)
          const whole = a.whole ?? wholeAnswer(await upstream.readAll(a.call, a.answer))
          a.handoff.done()
          if (whole.json === undefined) throw upstream.fail(a.call, { kind: 'bad-response', detail: 'answer is not JSON' })
          return a.fromPrefill ? withPrefillFacts(whole.json as Body, a.fromPrefill, isChat(a)) : (whole.json as Body)
        }),
      )
      return reply.code(200).type(JSON_TYPE).send(mergeCompletions(subs, parsed))
    }
    const streams = ok.map((a) => a.answer.body)
    const merged = async function* (this: void): AsyncGenerator<string> {
      try {
        yield* mergeStreams(body, subs, streams, (i, kind) => firstFrame(upstream, ok[i] as Answer & { kind: 'upstream' }, kind))
      } catch (err) {
        if (isRouterError(err)) {
          // A prompt's first token came too late to trust (firstFrame): the batch ends.
          ex.outcome(err.code)
          ex.abortUpstream(new BatchAborted())
          yield errorEvent(err)
          return
        }
        if (err instanceof EngineErrorEvent) {
          // One prompt's engine failed (its error event went out as it came): the batch ends.
          ex.outcome('engine_error_event')
          ex.abortUpstream(new BatchAborted())
          yield 'data: [DONE]\n\n'
          return
        }
        if (ex.signal.aborted) return
        const failed = ok.find((a) => a.answer.body.failed) ?? (ok[0] as Answer & { kind: 'upstream' })
        const mapped = upstream.fail(failed.call, { kind: 'transport', cause: err }).error
        ex.outcome(mapped.code)
        ex.abortUpstream(new BatchAborted())
        yield errorEvent(mapped)
      }
    }
    return reply.code(200).header('content-type', 'text/event-stream').header('cache-control', 'no-cache').send(Readable.from(merged()))
  }

  #failed(ex: Exchange, reply: FastifyReply, err: unknown): FastifyReply {
    if (ex.signal.reason instanceof ClientGone || err instanceof ClientGone) {
      ex.outcome('client_gone')
      return reply.code(499).send()
    }
    const mapped: Mapped = err instanceof LegFailure ? err.error : isRouterError(err) ? err : new RTR_ERR_INTERNAL((err as Error)?.message ?? String(err), { cause: err })
    ex.outcome(mapped.code)
    throw mapped
  }
}

const isChat = (a: Answer & { kind: 'upstream' }): boolean => isChatPath(a.call.path)

/** D's JSON answer with P's prompt facts (prefill-facts.ts); an answer that is not JSON goes on as it came. */
function withFacts(whole: WholeAnswer, a: Answer & { kind: 'upstream' }): Buffer | string {
  const { json } = whole
  if (typeof json !== 'object' || json === null || !a.fromPrefill) return whole.text
  // A string goes out as it is: the response schema would drop members it does not name.
  return JSON.stringify(withPrefillFacts(json as Body, a.fromPrefill, isChat(a)))
}

/** Every sub-request's result; the first failure stops the other prompts' legs. */
async function allOrStop<T>(ex: Exchange, work: Promise<T>[]): Promise<T[]> {
  try {
    return await Promise.all(work)
  } catch (err) {
    ex.abortUpstream(new BatchAborted())
    throw err
  }
}

/**
 * D's first frame of a streamed answer: data means its KV read is over (the lease is done);
 * its own error event means the decode failed (the lease is released to P at settle). Either
 * judges the pair. Data that came past the read deadline (Handoff.firstToken) returns the
 * error that replaces it: D's read may have found reused blocks.
 */
function firstFrame(upstream: Upstream, a: Answer & { kind: 'upstream' }, kind: 'data' | 'error'): Mapped | undefined {
  a.pairVerdict?.(kind === 'data')
  if (kind === 'data') upstream.firstToken(a.call, a.answer)
  if (kind === 'error') {
    a.handoff.decodeFailed()
    return undefined
  }
  if (a.handoff.firstToken()) return undefined
  return new RTR_ERR_LATE_READ(a.call.target.id, `handoff ${a.handoff.engineRequestId}`)
}
