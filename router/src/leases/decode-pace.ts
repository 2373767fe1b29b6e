/** Answers a decoder must have given before its pace is trusted. */
const WARM = 8
/** A faster answer moves the pace this share of the way down; a slower one sets it at once. */
const EASE = 0.02
/** The expected decode leg times this must fit in what is left of the read window. */
const SAFETY = 2

/**
 * How long each decoder has lately taken per generated token, for the read check's choice
 * of proof (leases.readCheck `router`, handoff.ts). D's whole answer arriving before the read
 * deadline proves its read came before it too, with no streamed leg to watch for the first
 * token; that proof is only worth trying for a generation that surely ends well inside the
 * window, since one that does not is prefilled again (an unproven read is never passed on).
 *
 * Pessimistic by construction: the pace of a decode leg is its whole time (queueing and
 * time to first token included) over the tokens it generated, so short answers make it
 * high; it rises at once with a slower answer and falls only slowly with faster ones.
 */
export class DecodePace {
  readonly #pace = new Map<string, { msPerToken: number; answers: number }>()

  /** One decode leg of `decode`: `ms` from sending it to D's whole answer, `tokens` generated. */
  observe(decode: string, ms: number, tokens: number): void {
    if (!(tokens >= 1 && ms >= 0)) return
    const per = ms / tokens
    const p = this.#pace.get(decode)
    if (!p) {
      this.#pace.set(decode, { msPerToken: per, answers: 1 })
      return
    }
    p.msPerToken = per >= p.msPerToken ? per : p.msPerToken + EASE * (per - p.msPerToken)
    p.answers++
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
    const v = get(member)
    if (typeof v === 'number' && Number.isInteger(v) && v >= 1) max = max === undefined ? v : Math.max(max, v)
  }
  return max
}

/** The tokens an answer says it generated (`usage.completion_tokens`), if it says. */
export function generatedTokens(answer: unknown): number | undefined {
  const usage = (answer as { usage?: { completion_tokens?: unknown } } | null)?.usage
  const n = usage?.completion_tokens
  return typeof n === 'number' && n >= 0 ? n : undefined
}
