type Body = Record<string, unknown>

/**
 * A `/v1/completions` batch (`prompt: [..]` of strings or of token-id lists) becomes one
 * handoff per prompt: vLLM returns kv_transfer_params for the first prompt only, so one
 * handoff for the batch would re-prefill every other prompt on D. Returns the per-prompt
 * bodies, or undefined for a single prompt (a string, or one list of token ids).
 */
export function splitBatch(body: Body): Body[] | undefined {
  const prompt = body.prompt
  if (!Array.isArray(prompt) || prompt.length === 0) return undefined
  if (prompt.every((p) => typeof p === 'number')) return undefined
  return prompt.map((p) => ({ ...body, prompt: p }))
}

interface Usage {
  prompt_tokens?: number
  completion_tokens?: number
  total_tokens?: number
}

function addUsage(into: Usage, u: unknown): void {
  if (typeof u !== 'object' || u === null) return
  const x = u as Usage
  for (const k of ['prompt_tokens', 'completion_tokens', 'total_tokens'] as const) {
    if (typeof x[k] === 'number') into[k] = (into[k] ?? 0) + x[k]
  }
}

function choicesPerPrompt(body: Body): number {
  return typeof body.n === 'number' && body.n > 1 ? body.n : 1
}

/** vLLM numbers a batch's choices prompt-major: prompt i, choice j → index i·n + j. */
function reindex(choices: unknown, prompt: number, n: number): unknown[] {
  if (!Array.isArray(choices)) return []
  return choices.map((c: Record<string, unknown>) => ({ ...c, index: prompt * n + (typeof c.index === 'number' ? c.index : 0) }))
}

/** Merges the non-streamed answers of a batch's handoffs into one, in prompt order. */
export function mergeCompletions(body: Body, answers: Body[]): Body {
  const n = choicesPerPrompt(body)
  const usage: Usage = {}
  const choices: unknown[] = []
  answers.forEach((a, i) => {
    choices.push(...reindex(a.choices, i, n))
    addUsage(usage, a.usage)
  })
  const { kv_transfer_params: _k, ...head } = answers[0] ?? {}
  return { ...head, choices, usage }
}

/** Splits SSE text into its `data:` payloads; returns them and the unfinished tail. */
function sseData(text: string): { data: string[]; rest: string } {
  const frames = text.split(/\r?\n\r?\n/)
  const rest = frames.pop() ?? ''
  const data: string[] = []
  for (const f of frames) {
    for (const line of f.split(/\r?\n/)) if (line.startsWith('data:')) data.push(line.slice(5).trimStart())
  }
  return { data, rest }
}

/** A batch stream carried an engine's own error event (passed on as it came): the batch ends there. */
export class EngineErrorEvent extends Error {
  constructor(readonly prompt: number) {
    super(`prompt ${prompt}: the engine's stream carried an error event`)
  }
}

/**
 * Interleaves the SSE streams of a batch's handoffs as vLLM streams a batch: chunks in the
 * order they come, choices renumbered prompt-major, one id for all, the usage chunks summed
 * into one at the end, one [DONE]. `onFirstFrame(i, kind)`: stream i's first whole frame, data
 * or the engine's error event. A stream that fails throws (the caller ends the response with an
 * error event); an engine's error event is yielded as it came, then EngineErrorEvent is thrown.
 */
export async function* mergeStreams(
  body: Body,
  streams: AsyncIterable<Buffer>[],
  onFirstFrame: (i: number, kind: 'data' | 'error') => void = () => {},
): AsyncGenerator<string> {
  const n = choicesPerPrompt(body)
  const usage: Usage = {}
  let sawUsage = false
  let id: unknown
  const iters = streams.map((s) => s[Symbol.asyncIterator]())
  const tails = streams.map(() => '')
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
    const { data, rest } = sseData(tails[i] + (r.value as Buffer).toString('utf8'))
    tails[i] = rest
    let out = ''
    for (const d of data) {
      if (d === '[DONE]') continue
      const chunk = JSON.parse(d) as Body
      const error = 'error' in chunk
      if (!started[i]) {
        started[i] = true
        onFirstFrame(i, error ? 'error' : 'data')
      }
      if (error) {
        yield `${out}data: ${d}\n\n`
        throw new EngineErrorEvent(i)
      }
      const choices = chunk.choices
      if (Array.isArray(choices) && choices.length === 0 && chunk.usage) {
        sawUsage = true
        addUsage(usage, chunk.usage)
        continue
      }
      id ??= chunk.id
      out += `data: ${JSON.stringify({ ...chunk, id, choices: reindex(choices, i, n) })}\n\n`
    }
    if (out) yield out
  }
  if (sawUsage) yield `data: ${JSON.stringify({ id, object: 'text_completion', model: body.model, choices: [], usage })}\n\n`
  yield 'data: [DONE]\n\n'
}
