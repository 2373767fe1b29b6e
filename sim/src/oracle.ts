import type { ChatMessage } from '../../schemas/openai.js'
import { SimConfig } from '../../schemas/sim-config.js'
import { prefillAndGenerate } from './generator.js'
import { KvRegion } from './kv-region.js'
import { promptTokens, resolveMaxTokens, stopCriteria, stopFieldsFrom, type PromptSpec, type StopFields } from './prompt.js'
import { applyStop, type Finished } from './stop.js'

/** The simulator's own defaults, read from its schema so the oracle can never drift from them. */
export const ORACLE_DEFAULTS = Object.freeze({
  bytesPerToken: (SimConfig.properties.bytesPerToken as unknown as { default: number }).default,
  defaultMaxTokens: (SimConfig.properties.defaultMaxTokens as unknown as { default: number }).default,
})

/** A prompt, its output length and vLLM's stop parameters (`stop`, `stop_token_ids`, ...). */
export type OracleInput =
  | ({ kind: 'chat'; messages: readonly ChatMessage[]; maxTokens?: number | null; maxCompletionTokens?: number | null } & StopFields)
  | ({ kind: 'completion'; prompt: string | number[]; maxTokens?: number | null } & StopFields)

export interface OracleOptions {
  /** Must equal the simulators' --bytes-per-token (the KV bytes, hence the text, depend on it). */
  bytesPerToken?: number
  /** Used when the input sets no max tokens; the simulators' --default-max-tokens. */
  defaultMaxTokens?: number
  /** The simulators' --eos-after-tokens (the EOS fault), if set. */
  eosAfterTokens?: number | null
}

/** Output token ids of a prompt, computed the way a correct engine computes them. */
export function oracleTokensFor(tokens: Uint32Array, maxTokens: number, bytesPerToken: number): number[] {
  // A private region sized to the prompt: block layout does not change the digest, which
  // runs over positions in order, so one block holding every position is enough.
  const region = KvRegion.allocate({ blockSize: Math.max(1, tokens.length), bytesPerToken, numBlocks: 1 })
  return prefillAndGenerate(region, [0], tokens, maxTokens)
}

/**
 * The exact text a correct cluster of simulators returns for this input: the `text` of a
 * completion or the assistant `content` of a chat completion, streamed chunks concatenated.
 */
export function oracleText(input: OracleInput, opts: OracleOptions = {}): string {
  return oracleOutput(input, opts).text
}

/**
 * The whole answer: output tokens (as counted in `completion_tokens`), text, per-token pieces,
 * `finish_reason` and `stop_reason`, the request's stop criteria applied as the engine applies them.
 */
export function oracleOutput(input: OracleInput, opts: OracleOptions = {}): Finished {
  const spec: PromptSpec = input
  const bytesPerToken = opts.bytesPerToken ?? ORACLE_DEFAULTS.bytesPerToken
  const maxTokens = resolveMaxTokens(spec, opts.defaultMaxTokens ?? ORACLE_DEFAULTS.defaultMaxTokens)
  return applyStop(oracleTokensFor(promptTokens(spec), maxTokens, bytesPerToken), stopCriteria(spec, opts.eosAfterTokens))
}

/**
 * The oracle for an OpenAI request body as a client sends it (`path` tells which kind), for
 * tests that drive the router with a body and compare what comes back.
 */
export function oracleForBody(
  path: '/v1/completions' | '/v1/chat/completions',
  body: { prompt?: unknown; messages?: unknown; max_tokens?: number | null; max_completion_tokens?: number | null },
  opts: OracleOptions = {},
): string {
  const stops = stopFieldsFrom(body as Record<string, unknown>)
  if (path === '/v1/chat/completions') {
    return oracleText(
      { kind: 'chat', messages: body.messages as ChatMessage[], maxTokens: body.max_tokens, maxCompletionTokens: body.max_completion_tokens, ...stops },
      opts,
    )
  }
  return oracleText({ kind: 'completion', prompt: body.prompt as string | number[], maxTokens: body.max_tokens, ...stops }, opts)
}
