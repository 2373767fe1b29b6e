import type { ChatMessage } from '../../schemas/openai.js'
import { SimConfig } from '../../schemas/sim-config.js'
import { detokenize, prefillAndGenerate } from './generator.js'
import { KvRegion } from './kv-region.js'
import { promptTokens, resolveMaxTokens, type PromptSpec } from './prompt.js'

/** The simulator's own defaults, read from its schema so the oracle can never drift from them. */
export const ORACLE_DEFAULTS = Object.freeze({
  bytesPerToken: (SimConfig.properties.bytesPerToken as unknown as { default: number }).default,
  defaultMaxTokens: (SimConfig.properties.defaultMaxTokens as unknown as { default: number }).default,
})

export type OracleInput =
  | { kind: 'chat'; messages: readonly ChatMessage[]; maxTokens?: number | null; maxCompletionTokens?: number | null }
  | { kind: 'completion'; prompt: string | number[]; maxTokens?: number | null }

export interface OracleOptions {
  /** Must equal the simulators' --bytes-per-token (the KV bytes, hence the text, depend on it). */
  bytesPerToken?: number
  /** Used when the input sets no max tokens; the simulators' --default-max-tokens. */
  defaultMaxTokens?: number
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
  const spec: PromptSpec = input
  const bytesPerToken = opts.bytesPerToken ?? ORACLE_DEFAULTS.bytesPerToken
  const maxTokens = resolveMaxTokens(spec, opts.defaultMaxTokens ?? ORACLE_DEFAULTS.defaultMaxTokens)
  return detokenize(oracleTokensFor(promptTokens(spec), maxTokens, bytesPerToken))
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
  if (path === '/v1/chat/completions') {
    return oracleText(
      { kind: 'chat', messages: body.messages as ChatMessage[], maxTokens: body.max_tokens, maxCompletionTokens: body.max_completion_tokens },
      opts,
    )
  }
  return oracleText({ kind: 'completion', prompt: body.prompt as string | number[], maxTokens: body.max_tokens }, opts)
}
