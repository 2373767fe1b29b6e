import type { ChatCompletionRequest, ChatMessage, CompletionRequest } from '../../schemas/openai.js'
import { renderChat } from './chat-template.js'
import { SIM_ERR_BAD_REQUEST, SIM_ERR_MAX_TOKENS_TOO_LARGE, SIM_ERR_PROMPT_TOO_LONG, SIM_ERR_UNSUPPORTED_PROMPT } from './errors.js'
import type { StopCriteria } from './stop.js'
import { tokenize } from './tokenizer.js'

/** What the engine needs from a request body: the prompt's token ids, output length, stops. */
export interface PromptInput {
  tokens: Uint32Array
  maxTokens: number
  stop: StopCriteria
}

/** vLLM's stop-related sampling parameters, as the request (or an oracle caller) gives them. */
export interface StopFields {
  stop?: string | readonly string[] | null
  stopTokenIds?: readonly number[] | null
  ignoreEos?: boolean | null
  minTokens?: number | null
}

export type PromptSpec =
  | ({ kind: 'chat'; messages: readonly ChatMessage[]; maxTokens?: number | null; maxCompletionTokens?: number | null } & StopFields)
  | ({ kind: 'completion'; prompt: CompletionRequest['prompt']; maxTokens?: number | null } & StopFields)

export interface PromptLimits {
  defaultMaxTokens: number
  maxModelLen: number
  /** SimConfig.eosAfterTokens: the model samples EOS as output token N. */
  eosAfterTokens?: number | undefined
}

export function specFromChat(body: ChatCompletionRequest): PromptSpec {
  return { kind: 'chat', messages: body.messages, maxTokens: body.max_tokens, maxCompletionTokens: body.max_completion_tokens, ...stopFieldsFrom(body) }
}

export function specFromCompletion(body: CompletionRequest): PromptSpec {
  return { kind: 'completion', prompt: body.prompt, maxTokens: body.max_tokens, ...stopFieldsFrom(body) }
}

/**
 * `stop`, `stop_token_ids`, `ignore_eos` and `min_tokens` from a body, type-checked here
 * rather than in the shared request schemas, which the router validates too and must keep
 * passing through. (`n` is the route's: one choice per child request, as vLLM serves it.)
 */
export function stopFieldsFrom(body: Record<string, unknown>): StopFields {
  const { stop, stop_token_ids: ids, ignore_eos: ignoreEos, min_tokens: minTokens } = body
  if (stop !== undefined && stop !== null && typeof stop !== 'string' && !(Array.isArray(stop) && stop.every((s) => typeof s === 'string'))) {
    throw new SIM_ERR_BAD_REQUEST('stop must be a string or a list of strings')
  }
  if (ids !== undefined && ids !== null && !(Array.isArray(ids) && ids.every((i) => Number.isInteger(i) && (i as number) >= 0))) {
    throw new SIM_ERR_BAD_REQUEST('stop_token_ids must be a list of token ids')
  }
  if (ignoreEos !== undefined && ignoreEos !== null && typeof ignoreEos !== 'boolean') throw new SIM_ERR_BAD_REQUEST('ignore_eos must be a boolean')
  return {
    stop: stop as StopFields['stop'],
    stopTokenIds: ids as StopFields['stopTokenIds'],
    ignoreEos: ignoreEos as StopFields['ignoreEos'],
    minTokens: minTokens as StopFields['minTokens'],
  }
}

/** The stop criteria of a spec, defaults filled as vLLM fills them. */
export function stopCriteria(spec: StopFields, eosAfterTokens?: number | null): StopCriteria {
  const stop = spec.stop ?? []
  return {
    stop: typeof stop === 'string' ? [stop] : [...stop],
    stopTokenIds: [...(spec.stopTokenIds ?? [])],
    ignoreEos: spec.ignoreEos ?? false,
    minTokens: spec.minTokens ?? 0,
    eosAfterTokens: eosAfterTokens ?? null,
  }
}

/** Token ids of the prompt; only one (a batch: promptBatch). */
export function promptTokens(spec: PromptSpec): Uint32Array {
  const batch = promptBatch(spec)
  if (batch.length !== 1) throw new SIM_ERR_UNSUPPORTED_PROMPT('a batch of several prompts where one is expected')
  return batch[0] as Uint32Array
}

/**
 * Token ids of each prompt: a completion request may carry a batch (a list of strings or of
 * token id lists), served as vLLM does, one prompt after another, choices in order.
 */
export function promptBatch(spec: PromptSpec): Uint32Array[] {
  if (spec.kind === 'chat') return [tokenize(renderChat(spec.messages))]
  const p = spec.prompt
  if (typeof p === 'string') return [tokenize(p)]
  if (p.length === 0) throw new SIM_ERR_BAD_REQUEST('prompt must not be empty')
  if (typeof p[0] === 'number') return [Uint32Array.from(p as number[])]
  return (p as (string | number[])[]).map((one) => (typeof one === 'string' ? tokenize(one) : Uint32Array.from(one)))
}

/**
 * Output length: max_completion_tokens wins over max_tokens for chat (OpenAI's rule), and a
 * missing value falls back to the configured default (vLLM's is 16 for /v1/completions; the
 * simulator uses the same default for chat so outputs stay short and predictable).
 */
export function resolveMaxTokens(spec: PromptSpec, defaultMaxTokens: number): number {
  const explicit = spec.kind === 'chat' ? (spec.maxCompletionTokens ?? spec.maxTokens) : spec.maxTokens
  return explicit ?? defaultMaxTokens
}

/** preparePrompt for each prompt of a batch. */
export function preparePrompts(spec: PromptSpec, limits: PromptLimits): PromptInput[] {
  return promptBatch(spec).map((tokens) => checkedInput(spec, tokens, limits))
}

/** Tokens plus output length, checked against the context window as vLLM checks them. */
export function preparePrompt(spec: PromptSpec, limits: PromptLimits): PromptInput {
  return checkedInput(spec, promptTokens(spec), limits)
}

function checkedInput(spec: PromptSpec, tokens: Uint32Array, limits: PromptLimits): PromptInput {
  const maxTokens = resolveMaxTokens(spec, limits.defaultMaxTokens)
  if (tokens.length > limits.maxModelLen) throw new SIM_ERR_PROMPT_TOO_LONG(limits.maxModelLen, tokens.length)
  if (tokens.length + maxTokens > limits.maxModelLen) throw new SIM_ERR_MAX_TOKENS_TOO_LARGE(limits.maxModelLen, maxTokens, tokens.length)
  return { tokens, maxTokens, stop: stopCriteria(spec, limits.eosAfterTokens) }
}
