/**
 * What only P knows about a prompt, carried into D's answer (issue 19 §3). D reads the
 * prompt's KV over NIXL instead of computing it, so its answer lacks what a prefill produces:
 * the prompt's logprobs (`prompt_logprobs`: per choice for completions, top level for chat)
 * and how many prompt tokens P found in its prefix cache
 * (`usage.prompt_tokens_details.cached_tokens`, with --enable-prompt-tokens-details). vLLM's
 * own P/D router merges them the same way; without it a client that asked for prompt
 * logprobs got null and a cache-hit count from the wrong engine.
 */

type Body = Record<string, unknown>

export interface PrefillFacts {
  promptLogprobs?: unknown
  cachedTokens?: number
}

const isObject = (v: unknown): v is Body => typeof v === 'object' && v !== null && !Array.isArray(v)

/** The facts in P's parsed answer, or undefined when it has none worth carrying. */
export function prefillFacts(answer: unknown, chat: boolean): PrefillFacts | undefined {
  if (!isObject(answer)) return undefined
  const facts: PrefillFacts = {}
  const first = Array.isArray(answer.choices) ? answer.choices[0] : undefined
  const logprobs = chat ? answer.prompt_logprobs : isObject(first) ? first.prompt_logprobs : undefined
  if (logprobs !== undefined && logprobs !== null) facts.promptLogprobs = logprobs
  const details = isObject(answer.usage) ? answer.usage.prompt_tokens_details : undefined
  if (isObject(details) && typeof details.cached_tokens === 'number') facts.cachedTokens = details.cached_tokens
  return Object.keys(facts).length > 0 ? facts : undefined
}

/** D's parsed answer with P's facts in place of its own (the object is changed and returned). */
export function withPrefillFacts(answer: Body, facts: PrefillFacts, chat: boolean): Body {
  if (facts.promptLogprobs !== undefined) {
    if (chat) answer.prompt_logprobs = facts.promptLogprobs
    else if (Array.isArray(answer.choices)) for (const c of answer.choices) if (isObject(c)) c.prompt_logprobs = facts.promptLogprobs
  }
  if (facts.cachedTokens !== undefined && isObject(answer.usage)) {
    const details = isObject(answer.usage.prompt_tokens_details) ? answer.usage.prompt_tokens_details : {}
    answer.usage.prompt_tokens_details = { ...details, cached_tokens: facts.cachedTokens }
  }
  return answer
}
