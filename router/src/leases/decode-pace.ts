/** Answers a decoder must have given before its pace is trusted. */
const WARM = 8
/** The pace is the time per token over at least this many of the newest generated tokens. */
const SPAN_TOKENS = 64
/** Samples kept per decoder (a span of 1-token answers is at most this long). */
const KEPT = 64
/** The expected decode leg times this must fit in what is left of the read window. */
const SAFETY = 2

interface Sample {
  ms: number
  tokens: number
}

/**
 * How long each decoder has lately taken per generated token, for the read check's choice
 * of proof (leases.readCheck `router`, handoff.ts). D's whole answer arriving before the read
 * deadline proves its read came before it too, with no streamed leg to watch for the first
 * token; that proof is only worth trying for a generation that surely ends well inside the
 * window, since one that does not is prefilled again (an unproven read is never passed on).
 *
 * The pace is the newest answers' whole times (queueing and time to first token included)
 * over the tokens they generated, summed over at least SPAN_TOKENS tokens: each answer counts
 * by its tokens. A slower decoder shows within that many tokens. A 1-token answer that queued
 * behind long ones counts as one token, so no one client can switch the proof off for a
 * decoder (issue 37 item 4: as a per-answer maximum with a slow fall, one such answer kept
 * the proof off for the next 100 answers). A leg dropped at the deadline counts too: it took
 * longer than the window it had for at most its `max_tokens` (`tooSlow`).
 */
export class DecodePace {
  readonly #pace = new Map<string, { samples: Sample[]; msPerToken: number; answers: number }>()

  /** One decode leg of `decode`: `ms` from sending it to D's whole answer, `tokens` generated. */
  observe(decode: string, ms: number, tokens: number): void {
    if (!(tokens >= 1 && ms >= 0)) return
    this.#add(decode, { ms, tokens }, 1)
  }

  /**
   * A leg of at most `maxTokens` tokens did not end within the `ms` it had (its whole answer
   * missed the read deadline): it counts as `ms` for `maxTokens`, a lower bound on its time.
   */
  tooSlow(decode: string, ms: number, maxTokens: number): void {
    if (!(maxTokens >= 1 && ms >= 0)) return
    this.#add(decode, { ms, tokens: maxTokens }, 0)
  }

  #add(decode: string, sample: Sample, answers: number): void {
    let p = this.#pace.get(decode)
    if (!p) this.#pace.set(decode, (p = { samples: [], msPerToken: 0, answers: 0 }))
    p.samples.push(sample)
    if (p.samples.length > KEPT) p.samples.shift()
    p.answers += answers
    let ms = 0
    let tokens = 0
    for (let i = p.samples.length - 1; i >= 0 && tokens < SPAN_TOKENS; i--) {
      const s = p.samples[i] as Sample
      ms += s.ms
      tokens += s.tokens
    }
    p.msPerToken = ms / tokens
  }

  /**
   * Whether a decode leg of at most `maxTokens` tokens on `decode` is expected to end well
   * within `windowMs`: its pace times `maxTokens`, doubled. False while the pace is not
   * known (fewer than WARM answers) or the request does not bound its tokens.
   */
  fits(decode: string, maxTokens: number | undefined, windowMs: number): boolean {
    const p = this.#pace.get(decode)
    if (!p || p.answers < WARM || maxTokens === undefined) return false
    return SAFETY * p.msPerToken * maxTokens <= windowMs
  }

  /** A decoder left the topology. */
  forget(decode: string): void {
    this.#pace.delete(decode)
  }
}

/**
 * The tokens a request may generate at most, when it says: `max_tokens` (completions and
 * chat), or chat's `max_completion_tokens`; the larger if both (vLLM prefers the latter).
 * Undefined otherwise: vLLM then generates up to the model's length, which the router does
 * not know.
 */
export function maxTokensOf(get: (member: string) => unknown): number | undefined {
  let max: number | undefined
  for (const member of ['max_tokens', 'max_completion_tokens']) {
    const v = tokenCount(get(member))
    if (v !== undefined && v >= 1) max = max === undefined ? v : Math.max(max, v)
  }
  return max
}

/**
 * A token count as vLLM reads it: its request models are pydantic's (`max_tokens: int | None`),
 * whose lax mode also takes a whole number written as a string: "16", " 16 ", "+16", "16.0",
 * "1_000" (checked against vLLM 0.32's venv). What is not a whole number has no bound here;
 * vLLM refuses it anyway.
 */
function tokenCount(v: unknown): number | undefined {
  if (typeof v === 'number') return Number.isInteger(v) ? v : undefined
  if (typeof v !== 'string') return undefined
  const m = /^\s*\+?([0-9][0-9_]{0,11})(?:\.0*)?\s*$/.exec(v)
  return m ? Number((m[1] as string).replaceAll('_', '')) : undefined
}

/** The tokens an answer says it generated (`usage.completion_tokens`), if it says. */
export function generatedTokens(answer: unknown): number | undefined {
  const usage = (answer as { usage?: { completion_tokens?: unknown } } | null)?.usage
  const n = usage?.completion_tokens
  return typeof n === 'number' && n >= 0 ? n : undefined
}
