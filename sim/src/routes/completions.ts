import { PassThrough } from 'node:stream'
import type { FastifyInstance, FastifyReply, FastifyRequest } from 'fastify'
import { sleep } from '../../../common/timers.js'
import { vllmRequestProblem } from '../../../common/vllm-request-rules.js'
import type { ChatCompletionRequest, CompletionRequest, Usage } from '../../../schemas/openai.js'
import type { SimContext } from '../context.js'
import { isKvLoadFailure, type EngineResult, type SimEngine } from '../engine.js'
import { SIM_ERR_BAD_REQUEST, SIM_ERR_DUPLICATE_REQUEST_ID, SIM_ERR_INJECTED, SIM_ERR_MODEL_NOT_FOUND } from '../errors.js'
import { promptLogprobs } from '../prompt-logprobs.js'
import { preparePrompts, specFromChat, specFromCompletion, type PromptInput, type PromptSpec } from '../prompt.js'

type Kind = 'completion' | 'chat'
type Body = CompletionRequest | ChatCompletionRequest

const errorResponses = { '4xx': { $ref: 'ErrorBody#' }, '5xx': { $ref: 'ErrorBody#' } }

/** POST /v1/completions and /v1/chat/completions, streamed (SSE) or not. */
export async function completionRoutes(app: FastifyInstance, ctx: SimContext): Promise<void> {
  app.post<{ Body: CompletionRequest }>(
    '/v1/completions',
    { schema: { body: { $ref: 'CompletionRequest#' }, response: { 200: { $ref: 'CompletionResponse#' }, ...errorResponses } } },
    (request, reply) => serve(ctx, 'completion', request, reply, specFromCompletion(request.body)),
  )
  app.post<{ Body: ChatCompletionRequest }>(
    '/v1/chat/completions',
    { schema: { body: { $ref: 'ChatCompletionRequest#' }, response: { 200: { $ref: 'ChatCompletionResponse#' }, ...errorResponses } } },
    (request, reply) => serve(ctx, 'chat', request, reply, specFromChat(request.body)),
  )
}

async function serve(ctx: SimContext, kind: Kind, request: FastifyRequest<{ Body: Body }>, reply: FastifyReply, spec: PromptSpec): Promise<unknown> {
  const { config, metrics } = ctx
  const body = request.body
  const fault = ctx.faults.decide(ctx.random)
  if (fault === 'crash') {
    request.log.fatal({ accepted: ctx.faults.accepted }, 'injected crash (crashAfter)')
    ctx.exit(1)
    // Only reached when exit is stubbed (tests): drop the connection as a dead process would.
    reply.hijack()
    reply.raw.destroy()
    return reply
  }
  if (fault === 'error') throw new SIM_ERR_INJECTED()
  if (fault === 'garbage') return reply.code(200).type('application/json').send('<html>not json: injected garbage</html>')

  // One signal for "stop working on this": the client left, or the app is closing.
  const clientGone = new AbortController()
  reply.raw.on('close', () => {
    if (!reply.raw.writableFinished) clientGone.abort(new Error('client disconnected'))
  })
  const signal = AbortSignal.any([clientGone.signal, ctx.shutdown])
  if (fault === 'stall') {
    request.log.warn({ stallMs: ctx.faults.current.stallMs }, 'injected stall')
    await sleep(ctx.clock, ctx.faults.current.stallMs, signal)
  }

  if (body.model !== config.model) throw new SIM_ERR_MODEL_NOT_FOUND(body.model)
  const problem = vllmRequestProblem(body, kind === 'chat')
  if (problem) throw new SIM_ERR_BAD_REQUEST(problem.message)
  const engine = engineFor(ctx, request.headers['x-data-parallel-rank'])
  // A completion request may carry a batch of prompts: vLLM serves each, choices in order.
  const inputs = preparePrompts(spec, { ...config, eosAfterTokens: ctx.faults.current.eosAfterTokens })
  const responseId = `${kind === 'chat' ? 'chatcmpl' : 'cmpl'}-${request.id}`

  // vLLM builds its request id from X-Request-Id; without the random suffix (older
  // releases, VLLM_DISABLE_REQUEST_ID_RANDOMIZATION) a reused id collides with the request
  // still running. The simulator always refuses it, so a router that reuses ids is caught.
  const header = request.headers['x-request-id']
  const xRequestId = typeof header === 'string' ? header : undefined
  if (xRequestId !== undefined) {
    if (ctx.inFlightIds.has(xRequestId)) throw new SIM_ERR_DUPLICATE_REQUEST_ID(xRequestId)
    ctx.inFlightIds.add(xRequestId)
  }
  // Past max_num_seqs the request waits its turn, as vLLM's scheduler holds it.
  metrics.waiting.inc(metrics.labels)
  try {
    await ctx.seqs.acquire(signal)
  } catch (err) {
    if (xRequestId !== undefined) ctx.inFlightIds.delete(xRequestId)
    throw err
  } finally {
    metrics.waiting.dec(metrics.labels)
  }
  metrics.running.inc(metrics.labels)
  let finished = false
  const done = (ok: boolean, result?: EngineResult): void => {
    if (finished) return
    finished = true
    if (xRequestId !== undefined) ctx.inFlightIds.delete(xRequestId)
    ctx.seqs.release()
    metrics.running.dec(metrics.labels)
    if (ok && result) {
      metrics.success.inc({ ...metrics.labels, finished_reason: result.output.finishReason })
      metrics.generationTokens.inc(metrics.labels, result.output.tokens.length)
    }
  }
  const choices: EngineResult[] = []
  /** Each choice's prompt. */
  const choiceInputs: PromptInput[] = []
  // Per prompt, as vLLM counts num_cached_tokens: the first choice's lookup.
  let cachedTokens = 0
  try {
    // n > 1 as vLLM's decoder serves it: one child request per choice, each loading the remote
    // KV itself (one READ of P's blocks per choice), one after another here. P's lease is for
    // one read, so every child after the first reads blocks P may already have reused.
    const n = typeof body.n === 'number' && body.n > 1 ? body.n : 1
    // vLLM skips reading the prefix cache for requests with prompt logprobs (SamplingParams).
    const { prompt_logprobs: promptLogprobsAsked } = body as Record<string, unknown>
    const askedPromptLogprobs = promptLogprobsAsked !== undefined && promptLogprobsAsked !== null
    const remote = (body.kv_transfer_params as { do_remote_prefill?: unknown } | null | undefined)?.do_remote_prefill === true
    for (const input of inputs) {
      const run = (): Promise<EngineResult> =>
        engine.run({ responseId, input, kvTransferParams: body.kv_transfer_params, signal, log: request.log, failKvLoad: fault === 'kv_load_failure', skipReadingPrefixCache: askedPromptLogprobs })
      const first = await run()
      cachedTokens += first.reportedCachedTokens
      for (let j = 0; j < n; j++) {
        choices.push(j === 0 || !remote ? first : await run())
        choiceInputs.push(input)
      }
    }
  } catch (err) {
    done(false)
    if (isKvLoadFailure(err)) {
      ctx.requests.annotate(request.raw, { kvLoad: 'failed', kvLoadError: err.agentCode })
      if (body.stream === true) return streamError(request, reply, err, kind, { id: responseId, model: config.model, created: Math.floor(ctx.clock.now() / 1000), n: typeof body.n === 'number' && body.n > 1 ? body.n : 1 })
    }
    throw err
  }
  const result = choices[0] as EngineResult
  const { output } = result
  request.log.info(
    { internalId: result.internalId, mode: result.mode, promptTokens: result.promptTokens, outputTokens: output.tokens.length, finishReason: output.finishReason },
    'request served',
  )
  ctx.requests.annotate(request.raw, {
    finishReason: output.finishReason,
    stopReason: output.stopReason,
    kvTransferParams: result.kvTransferParams,
    ...(result.kvLoad ? { kvLoad: result.kvLoad.outcome } : {}),
    ...(result.kvLoad?.agentCode ? { kvLoadError: result.kvLoad.agentCode } : {}),
  })
  const created = Math.floor(ctx.clock.now() / 1000)
  const completionTokens = choices.reduce((sum, c) => sum + c.output.tokens.length, 0)
  const promptTokens = inputs.reduce((sum, i) => sum + i.tokens.length, 0)
  const usage: Usage = {
    prompt_tokens: promptTokens,
    completion_tokens: completionTokens,
    total_tokens: promptTokens + completionTokens,
    // Only with --enable-prompt-tokens-details, as vLLM.
    ...(config.enablePromptTokensDetails ? { prompt_tokens_details: { cached_tokens: cachedTokens } } : {}),
  }
  const head = { id: responseId, created, model: config.model }

  if (body.stream === true) {
    const includeUsage = (body.stream_options as { include_usage?: unknown } | null | undefined)?.include_usage === true
    const frames = sseFrames(kind, head, choices, includeUsage ? usage : undefined)
    if (fault === 'disconnect') {
      done(false)
      // Headers and the first frames reach the client, then the socket goes.
      reply.hijack()
      reply.raw.writeHead(200, { 'content-type': 'text/event-stream', 'cache-control': 'no-cache' })
      const first = frames.next().value ?? ''
      const second = kind === 'chat' ? (frames.next().value ?? '') : ''
      reply.raw.write(first + second, () => reply.raw.destroy())
      return reply
    }
    const stream = new PassThrough()
    reply.header('content-type', 'text/event-stream').header('cache-control', 'no-cache')
    void paceFrames(ctx, frames, stream, signal).then(
      () => done(true, result),
      (err: unknown) => {
        done(false)
        request.log.warn({ err }, 'stream ended early')
      },
    )
    return reply.send(stream)
  }

  try {
    // The first token comes out of prefill; each further one costs a decode step.
    await sleep(ctx.clock, config.decodeDelayMs * Math.max(0, output.tokens.length - 1), signal)
  } catch (err) {
    done(false)
    throw err
  }
  // Asked for, prompt logprobs come from the engine that computed the prompt (prompt-logprobs.ts).
  const asked = typeof (body as Record<string, unknown>).prompt_logprobs === 'number'
  const logprobsOf = (c: EngineResult, input: PromptInput): unknown => (c.mode === 'remote-decode' ? null : promptLogprobs(input.tokens))
  const payload = {
    ...head,
    object: kind === 'chat' ? 'chat.completion' : 'text_completion',
    choices: choices.map((c, index) => {
      const { text, finishReason, stopReason } = c.output
      return kind === 'chat'
        ? { index, message: { role: 'assistant', content: text }, logprobs: null, finish_reason: finishReason, stop_reason: stopReason }
        : { index, text, logprobs: null, finish_reason: finishReason, stop_reason: stopReason, ...(asked ? { prompt_logprobs: logprobsOf(c, choiceInputs[index] as PromptInput) } : {}) }
    }),
    ...(asked && kind === 'chat' ? { prompt_logprobs: logprobsOf(result, inputs[0] as PromptInput) } : {}),
    usage,
    kv_transfer_params: result.kvTransferParams,
  }
  if (fault === 'disconnect') {
    done(false)
    // Headers and part of the body, then the socket goes: what a crashing engine looks like.
    reply.hijack()
    reply.raw.writeHead(200, { 'content-type': 'application/json' })
    reply.raw.write(JSON.stringify(payload).slice(0, 16), () => reply.raw.destroy())
    return reply
  }
  done(true, result)
  return reply.send(payload)
}

/**
 * The data-parallel rank serving a request: the one vLLM's X-data-parallel-rank header names
 * (a value that is not an integer is ignored, as vLLM ignores it; one out of range is 400, as
 * vLLM's input processor refuses it), else the next rank in turn. vLLM's own balancer picks
 * the least loaded rank; round robin is enough to alternate engine_ids behind one port.
 */
function engineFor(ctx: SimContext, header: string | string[] | undefined): SimEngine {
  const raw = typeof header === 'string' ? header.trim() : ''
  if (/^[+-]?\d+$/.test(raw)) {
    const rank = Number(raw)
    const named = ctx.engines[rank]
    if (!named) throw new SIM_ERR_BAD_REQUEST(`data_parallel_rank ${rank} is out of range [0, ${ctx.engines.length}).`)
    return named
  }
  const next = ctx.engines[ctx.nextRank % ctx.engines.length] as SimEngine
  ctx.nextRank = (ctx.nextRank + 1) % ctx.engines.length
  return next
}

/**
 * A streamed request that failed before its first token (a KV load failure under policy
 * `fail`): vLLM's streaming generators answer 200, then `data: {"error": {...}}` and
 * `data: [DONE]`, since a stream's status is sent before the engine has run. vLLM 0.32's chat
 * generator sends each choice's role preamble first, on the engine's first output, which a
 * failed load also produces: so a chat stream's error event is never its first frame.
 */
function streamError(
  request: FastifyRequest,
  reply: FastifyReply,
  err: Error & { code: string },
  kind: Kind,
  head: { id: string; model: string; created: number; n: number },
): FastifyReply {
  request.log.error({ err }, 'request failed')
  const error = { message: err.message, type: 'InternalServerError', param: null, code: err.code }
  let preamble = ''
  if (kind === 'chat') {
    for (let index = 0; index < head.n; index++) {
      const choices = [{ index, delta: { role: 'assistant', content: '' }, logprobs: null, finish_reason: null }]
      preamble += `data: ${JSON.stringify({ id: head.id, object: 'chat.completion.chunk', created: head.created, model: head.model, choices })}\n\n`
    }
  }
  return reply
    .code(200)
    .header('content-type', 'text/event-stream')
    .header('cache-control', 'no-cache')
    .send(`${preamble}data: ${JSON.stringify({ error })}\n\ndata: [DONE]\n\n`)
}

/**
 * The SSE frames of a streamed answer, in vLLM's shapes: for chat a first frame with the
 * assistant role per choice, then one frame per token and choice (the last with
 * finish_reason), an optional usage frame with empty choices, and `data: [DONE]`. Yields
 * `null` between token steps, where a decode step's delay belongs.
 */
function* sseFrames(kind: Kind, head: { id: string; created: number; model: string }, results: readonly EngineResult[], usage: Usage | undefined): Generator<string | null> {
  const object = kind === 'chat' ? 'chat.completion.chunk' : 'text_completion'
  const frame = (choices: unknown[], extra?: object): string =>
    `data: ${JSON.stringify({ id: head.id, object, created: head.created, model: head.model, choices, ...extra })}\n\n`
  if (kind === 'chat') {
    for (let index = 0; index < results.length; index++) yield frame([{ index, delta: { role: 'assistant', content: '' }, logprobs: null, finish_reason: null }])
  }
  const steps = Math.max(...results.map((r) => r.output.pieces.length))
  for (let i = 0; i < steps; i++) {
    if (i > 0) yield null
    for (let index = 0; index < results.length; index++) {
      const { pieces, finishReason, stopReason } = (results[index] as EngineResult).output
      if (i >= pieces.length) continue
      // A stop token or the cut part of a stop string has no text; its frame still carries
      // the finish reason, as vLLM's last chunk does.
      const text = pieces[i] as string
      const last = i === pieces.length - 1
      const finish = last ? finishReason : null
      const stop = last ? stopReason : null
      yield frame([
        kind === 'chat'
          ? { index, delta: { content: text }, logprobs: null, finish_reason: finish, stop_reason: stop }
          : { index, text, logprobs: null, finish_reason: finish, stop_reason: stop },
      ])
    }
  }
  if (usage) yield frame([], { usage })
  yield 'data: [DONE]\n\n'
}

/** Writes frames to `out`, sleeping one decode delay at each `null` between token frames. */
async function paceFrames(ctx: SimContext, frames: Generator<string | null>, out: PassThrough, signal: AbortSignal): Promise<void> {
  try {
    for (const f of frames) {
      if (f === null) {
        await sleep(ctx.clock, ctx.config.decodeDelayMs, signal)
        continue
      }
      if (signal.aborted) throw signal.reason
      out.write(f)
    }
    out.end()
  } catch (err) {
    if (!out.destroyed) out.destroy()
    throw err
  }
}
