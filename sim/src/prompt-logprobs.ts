/**
 * `prompt_logprobs` in vLLM's shape: null for the first prompt token, then one
 * `{ "<token id>": { logprob, rank, decoded_token } }` per token after it. Deterministic from
 * the token ids and positions (the simulator has no model), so the same prompt gives the same
 * values on any engine that computes it.
 *
 * Only an engine that computed the prompt has them. A decoder that read the prompt's KV from
 * P computed none of it and answers `prompt_logprobs: null`, as vLLM's does, so a router that
 * does not carry P's into D's answer hands the client null (issue 19 §3).
 */
export type PromptLogprobs = (Record<string, { logprob: number; rank: number; decoded_token: string }> | null)[]

export function promptLogprobs(tokens: Uint32Array): PromptLogprobs {
  const out: PromptLogprobs = [null]
  for (let i = 1; i < tokens.length; i++) {
    const id = tokens[i] as number
    const logprob = -(((id * 31 + i * 17) % 997) / 100) - 0.01
    out.push({ [String(id)]: { logprob, rank: 1 + ((id + i) % 50), decoded_token: `t${id}` } })
  }
  return out
}
