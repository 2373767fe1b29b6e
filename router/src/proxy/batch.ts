import { StringDecoder } from 'node:string_decoder'
import { sseData, verdictOf } from './relay.js'
import { SharedBody, type BodyView } from './shared-body.js'

type Body = Record<string, unknown>

/**
 * One handoff of a request that needs several: prompt `prompt`'s choice `choice`, whose one
 * choice is numbered `index` in the merged answer. `view` is its body, sharing the client's
 * (`body` materialises it, for inspection).
 */
export interface SubRequest {
  view: BodyView
  readonly body: Body
  prompt: number
  choice: number
  index: number
}

/** The members splitRequest changes. */
export const SPLIT_MEMBERS: readonly string[] = ['prompt', 'n', 'seed']

/**
 * A request becomes one handoff per prompt and choice (DESIGN "One request, end to end"):
 * - a `/v1/completions` batch (`prompt: [..]` of strings or of token-id lists): vLLM returns
 *   kv_transfer_params for the first prompt only, so one handoff for the batch would
 *   re-prefill every other prompt on D;
 * - `n > 1` (issue 17 item 7): vLLM's decoder loads the remote KV once per choice while P's
 *   lease is for one read, so every choice after the first would read blocks P already
 *   freed (and may have reused). Each choice is its own handoff with `n: 1` and its own lease;
 *   with a `seed`, choice j gets `seed + j`, so seeded choices still differ.
 * Sub-requests come prompt-major, as vLLM numbers a batch's choices (prompt i, choice j →
 * index i·n + j). Each sub-request is a view of `root` (default: of `body`, as it is): no
 * sub-request copies the client's body (issue 18 item 3). Returns undefined when the request
 * is one handoff as it is.
 */
export function splitRequest(body: Body, path: string, root: BodyView = new SharedBody(body, SPLIT_MEMBERS).view()): SubRequest[] | undefined {
  const prompts = path === '/v1/completions' ? batchPrompts(body) : undefined
  const n = typeof body.n === 'number' && body.n > 1 ? body.n : 1
  if (!prompts && n === 1) return undefined
  const subs: SubRequest[] = []
  const seed = root.get('seed')
  const views = prompts ? prompts.map((p) => root.with({ prompt: p })) : [root]
  views.forEach((v, prompt) => {
    for (let choice = 0; choice < n; choice++) {
      const view = n === 1 ? v : v.with(typeof seed === 'number' ? { n: 1, seed: seed + choice } : { n: 1 })
      subs.push({
        view,
        get body() {
          return view.toObject()
        },
        prompt,
        choice,
        index: prompt * n + choice,
      })
    }
  })
  return subs
}

/** A batch's prompts (strings or token-id lists); undefined for a single prompt. */
function batchPrompts(body: Body): unknown[] | undefined {
  const prompt = body.prompt
  if (!Array.isArray(prompt) || prompt.length === 0) return undefined
  if (prompt.every((p) => typeof p === 'number')) return undefined
  return prompt
}

interface Usage {
  prompt_tokens?: number
  completion_tokens?: number
  total_tokens?: number
}

/** Adds one sub-request's usage: its prompt counts once, with its first choice. */
function addUsage(into: Usage, u: unknown, sub: SubRequest | undefined): void {
  if (typeof u !== 'object' || u === null) return
  const x = u as Usage
  const keys = sub === undefined || sub.choice === 0 ? (['prompt_tokens', 'completion_tokens'] as const) : (['completion_tokens'] as const)
  for (const k of keys) if (typeof x[k] === 'number') into[k] = (into[k] ?? 0) + x[k]
  into.total_tokens = (into.prompt_tokens ?? 0) + (into.completion_tokens ?? 0)
}

/** A sub-request's choices, renumbered into the merged answer. */
function reindex(choices: unknown, sub: SubRequest | undefined): unknown[] {
  if (!Array.isArray(choices)) return []
  return choices.map((c: Record<string, unknown>) => ({ ...c, index: (sub?.index ?? 0) + (typeof c.index === 'number' ? c.index : 0) }))
}

/** Merges the non-streamed answers of a request's handoffs into one, in index order. */
export function mergeCompletions(subs: readonly SubRequest[], answers: Body[]): Body {
  const usage: Usage = {}
  const choices: unknown[] = []
  answers.forEach((a, i) => {
    choices.push(...reindex(a.choices, subs[i]))
    addUsage(usage, a.usage, subs[i])
  })
  const { kv_transfer_params: _k, ...head } = answers[0] ?? {}
  return { ...head, choices, usage }
}

/** A batch stream carried an engine's own error event (passed on as it came): the batch ends there. */
export class EngineErrorEvent extends Error {
  constructor(readonly prompt: number) {
    super(`prompt ${prompt}: the engine's stream carried an error event`)
  }
}

/**
 * Interleaves the SSE streams of a request's handoffs as vLLM streams a batch or n choices:
 * chunks in the order they come, choices renumbered prompt-major, one id for all, the usage
 * chunks summed into one at the end, one [DONE]. `onFirstFrame(i, kind)`: stream i's first
 * telling frame (past a chat role preamble), data or the engine's error event; an error it
 * returns is thrown in that frame's place. A stream that
 * fails throws (the caller ends the response with an error event); an engine's error event is
 * yielded as it came, then EngineErrorEvent is thrown.
 */
export async function* mergeStreams(
  body: Body,
  subs: readonly SubRequest[],
  streams: AsyncIterable<Buffer>[],
  onFirstFrame: (i: number, kind: 'data' | 'error') => Error | undefined = () => undefined,
): AsyncGenerator<string> {
  const usage: Usage = {}
  let sawUsage = false
  let id: unknown
  let object: unknown
  const iters = streams.map((s) => s[Symbol.asyncIterator]())
  const tails = streams.map(() => '')
  // A character's bytes may arrive in two reads.
  const decoders = streams.map(() => new StringDecoder('utf8'))
  const started = streams.map(() => false)
  // Failures become values, so a stream that fails after another already did is not unhandled.
  const next = (i: number) =>
    (iters[i] as AsyncIterator<Buffer>).next().then(
      (r) => ({ i, r, err: undefined as unknown }),
      (err: unknown) => ({ i, r: undefined, err }),
    )
  const pending = new Map(iters.map((_, i) => [i, next(i)]))
  while (pending.size > 0) {
    const { i, r, err } = await Promise.race(pending.values())
    if (!r) throw err
    if (r.done) {
      pending.delete(i)
      continue
    }
    pending.set(i, next(i))
    const { data, rest } = sseData(tails[i] + (decoders[i] as StringDecoder).write(r.value as Buffer))
    tails[i] = rest
    let out = ''
    for (const d of data) {
      if (d === '[DONE]') continue
      const chunk = JSON.parse(d) as Body
      const error = 'error' in chunk
      // A chat role preamble comes before D's KV read is known (relay.ts verdictOf).
      const verdict = started[i] ? undefined : verdictOf(chunk)
      if (verdict) {
        started[i] = true
        const stop = onFirstFrame(i, verdict)
        if (stop) throw stop
      }
      if (error) {
        yield `${out}data: ${d}\n\n`
        throw new EngineErrorEvent(i)
      }
      const choices = chunk.choices
      if (Array.isArray(choices) && choices.length === 0 && chunk.usage) {
        sawUsage = true
        addUsage(usage, chunk.usage, subs[i])
        continue
      }
      id ??= chunk.id
      object ??= chunk.object
      out += `data: ${JSON.stringify({ ...chunk, id, choices: reindex(choices, subs[i]) })}\n\n`
    }
    if (out) yield out
  }
  if (sawUsage) yield `data: ${JSON.stringify({ id, object: object ?? 'text_completion', model: body.model, choices: [], usage })}\n\n`
  yield 'data: [DONE]\n\n'
}
