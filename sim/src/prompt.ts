import type { ChatCompletionRequest, ChatMessage, CompletionRequest } from '../../schemas/openai.js'
import { renderChat } from './chat-template.js'
import { SimMaxTokensTooLargeError, SimPromptTooLongError, SimUnsupportedPromptError } from './errors.js'
import { tokenize } from './tokenizer.js'

/** What the engine needs from a request body: the prompt's token ids and the output length. */
export interface PromptInput {
  tokens: Uint32Array
  maxTokens: number
}

export type PromptSpec =
  | { kind: 'chat'; messages: readonly ChatMessage[]; maxTokens?: number | null; maxCompletionTokens?: number | null }
  | { kind: 'completion'; prompt: CompletionRequest['prompt']; maxTokens?: number | null }

export interface PromptLimits {
  defaultMaxTokens: number
  maxModelLen: number
}

export function specFromChat(body: ChatCompletionRequest): PromptSpec {
  return { kind: 'chat', messages: body.messages, maxTokens: body.max_tokens, maxCompletionTokens: body.max_completion_tokens }
}

export function specFromCompletion(body: CompletionRequest): PromptSpec {
  return { kind: 'completion', prompt: body.prompt, maxTokens: body.max_tokens }
}

/** Token ids of the prompt; one prompt per request (batched prompts are not simulated). */
export function promptTokens(spec: PromptSpec): Uint32Array {
  if (spec.kind === 'chat') return tokenize(renderChat(spec.messages))
  const p = spec.prompt
  if (typeof p === 'string') return tokenize(p)
  if (p.length !== 1 && typeof p[0] !== 'number') throw new SimUnsupportedPromptError('a batch of several prompts in one request')
  const first = p[0]
  if (typeof first === 'string') return tokenize(first)
  if (typeof first === 'number') return Uint32Array.from(p as number[])
  return Uint32Array.from(first as number[])
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

/** Tokens plus output length, checked against the context window as vLLM checks them. */
export function preparePrompt(spec: PromptSpec, limits: PromptLimits): PromptInput {
  const tokens = promptTokens(spec)
  const maxTokens = resolveMaxTokens(spec, limits.defaultMaxTokens)
  if (tokens.length > limits.maxModelLen) throw new SimPromptTooLongError(limits.maxModelLen, tokens.length)
  if (tokens.length + maxTokens > limits.maxModelLen) throw new SimMaxTokensTooLargeError(limits.maxModelLen, maxTokens, tokens.length)
  return { tokens, maxTokens }
}
