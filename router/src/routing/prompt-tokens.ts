import { createHash } from 'node:crypto'
import { request, type Dispatcher } from 'undici'
import type { TokenizeResponse } from '../../../schemas/openai.js'

/*
 * A prompt's token ids as the engine sees them (issue 39 part 2), for the prefix index: the
 * engine's own `POST /tokenize` (vLLM's; the simulator's), so the chat template, special tokens
 * and tokenizer are the engine's by construction, for any model it serves. Answers are cached
 * by the request's text (bounded, least recently used first). A prompt given as token ids needs
 * no call. Anything else (a batch, an answer that is late or wrong) is `undefined`: the request
 * is then routed on load alone, never failed for it.
 */

/** What the body asks the engine to tokenize: a /tokenize body, the ids themselves, or nothing. */
export type TokenizeInput = { body: Record<string, unknown> } | { tokens: readonly number[] } | undefined

/** Fields of a chat request that change how vLLM renders its prompt (TokenizeChatRequest's). */
const CHAT_FIELDS = ['add_generation_prompt', 'continue_final_message', 'add_special_tokens', 'chat_template', 'chat_template_kwargs', 'tools', 'documents'] as const

/** The /tokenize request for one completion or chat body (`get` reads the client's body). */
export function tokenizeInput(chat: boolean, get: (key: string) => unknown): TokenizeInput {
  const model = get('model')
  if (chat) {
    const messages = get('messages')
    if (!Array.isArray(messages)) return undefined
    const body: Record<string, unknown> = { model, messages }
    for (const k of CHAT_FIELDS) {
      const v = get(k)
      if (v !== undefined && v !== null) body[k] = v
    }
    return { body }
  }
  let prompt = get('prompt')
  if (Array.isArray(prompt) && prompt.length === 1 && (typeof prompt[0] === 'string' || Array.isArray(prompt[0]))) prompt = prompt[0]
  if (typeof prompt === 'string') {
    const body: Record<string, unknown> = { model, prompt }
    const special = get('add_special_tokens')
    if (typeof special === 'boolean') body.add_special_tokens = special
    return { body }
  }
  if (Array.isArray(prompt) && prompt.length > 0 && prompt.every((t) => Number.isInteger(t) && (t as number) >= 0)) return { tokens: prompt as number[] }
  return undefined
}

export interface PromptTokensOptions {
  dispatcher: Dispatcher
  timeoutMs: number
  cacheEntries: number
  /** Sent as `Authorization: Bearer` (the engines' --api-key). */
  apiKey?: string | undefined
  /** Each lookup's outcome: `cached`, `tokenized`, `ids` (given as token ids), `failed`. */
  onOutcome?: (outcome: 'cached' | 'tokenized' | 'ids' | 'failed', ms: number) => void
}

export class PromptTokens {
  readonly #o: PromptTokensOptions
  /** Key of the /tokenize body → its token ids; insertion order is least recently used first. */
  readonly #cache = new Map<string, Uint32Array>()

  constructor(o: PromptTokensOptions) {
    this.#o = o
  }

  /** The prompt's token ids, asking `engineUrl` when they are not known; undefined when they cannot be had. */
  async of(input: TokenizeInput, engineUrl: string, signal: AbortSignal): Promise<Uint32Array | undefined> {
    if (input === undefined) return undefined
    const started = performance.now()
    if ('tokens' in input) {
      this.#o.onOutcome?.('ids', 0)
      return Uint32Array.from(input.tokens)
    }
    const text = JSON.stringify(input.body)
    const key = createHash('sha256').update(text).digest('base64')
    const hit = this.#cache.get(key)
    if (hit) {
      this.#cache.delete(key)
      this.#cache.set(key, hit)
      this.#o.onOutcome?.('cached', performance.now() - started)
      return hit
    }
    const tokens = await this.#ask(engineUrl, text, signal)
    this.#o.onOutcome?.(tokens ? 'tokenized' : 'failed', performance.now() - started)
    if (tokens && this.#o.cacheEntries > 0) {
      this.#cache.set(key, tokens)
      if (this.#cache.size > this.#o.cacheEntries) this.#cache.delete(this.#cache.keys().next().value as string)
    }
    return tokens
  }

  async #ask(engineUrl: string, body: string, signal: AbortSignal): Promise<Uint32Array | undefined> {
    const { dispatcher, timeoutMs, apiKey } = this.#o
    try {
      const res = await request(`${engineUrl}/tokenize`, {
        method: 'POST',
        dispatcher,
        body,
        headers: { 'content-type': 'application/json', ...(apiKey ? { authorization: `Bearer ${apiKey}` } : {}) },
        headersTimeout: timeoutMs,
        bodyTimeout: timeoutMs,
        signal: AbortSignal.any([signal, AbortSignal.timeout(timeoutMs)]),
      })
      if (res.statusCode !== 200) {
        await res.body.dump()
        return undefined
      }
      const answer = (await res.body.json()) as Partial<TokenizeResponse>
      const tokens = answer.tokens
      if (!Array.isArray(tokens) || !tokens.every((t) => Number.isInteger(t) && t >= 0 && t < 2 ** 32)) return undefined
      return Uint32Array.from(tokens)
    } catch {
      return undefined
    }
  }
}
