import { StringDecoder } from 'node:string_decoder'
import { sseData, verdictOf } from './relay.js'

/**
 * A non-streamed answer built from D's streamed one (leases.readCheck `router`). The router
 * must see when D's first token came to know whether D's read of P's blocks was in time
 * (exchange.ts Handoff.firstToken), and vLLM sends a non-streamed answer's head only when
 * generation ends, so the decode leg of a non-streamed P/D request is streamed from D with
 * usage and put back together here, as vLLM builds its own non-streamed answer: the
 * choices' text (or message), logprobs, token ids and finish, the usage, the first chunk's
 * id, created, model and fingerprint. Members a chunk does not carry (prompt_logprobs: D
 * never computed the prompt) are null, as in vLLM's answer; P's are merged in afterwards
 * (prefill-facts.ts).
 */

type Body = Record<string, unknown>

const isObject = (v: unknown): v is Body => typeof v === 'object' && v !== null && !Array.isArray(v)

/** D's stream carried its own error event: the decode failed (vLLM's answer to a failed KV load). */
export class StreamedError extends Error {
  constructor(readonly event: string) {
    super('the decode stream carried an error event')
  }
}

interface ToolCall {
  id?: unknown
  type?: unknown
  function: { name: string; arguments: string }
}

interface Choice {
  index: number
  text: string
  content: string | undefined
  reasoning: string | undefined
  role: unknown
  toolCalls: ToolCall[]
  logprobs: { text_offset: unknown[]; token_logprobs: unknown[]; tokens: unknown[]; top_logprobs: unknown[] } | undefined
  chatLogprobs: unknown[] | undefined
  tokenIds: unknown[] | undefined
  promptTokenIds: unknown
  finish: unknown
  stopReason: unknown
}

const concat = (to: unknown[], from: unknown): void => {
  if (Array.isArray(from)) for (const x of from) to.push(x)
}

export class AnswerAssembler {
  readonly #chat: boolean
  readonly #choices = new Map<number, Choice>()
  #head: Body | undefined
  #usage: unknown = null
  #fingerprint: unknown
  #promptTokenIds: unknown = null

  constructor(chat: boolean) {
    this.#chat = chat
  }

  /** One parsed data frame of D's stream. */
  add(chunk: Body): void {
    this.#head ??= chunk
    if (isObject(chunk.usage)) this.#usage = chunk.usage
    // vLLM 0.32 names its fingerprint in the usage chunk only.
    if (chunk.system_fingerprint != null) this.#fingerprint = chunk.system_fingerprint
    if (chunk.prompt_token_ids != null) this.#promptTokenIds = chunk.prompt_token_ids
    if (!Array.isArray(chunk.choices)) return
    for (const c of chunk.choices) if (isObject(c)) this.#choice(c)
  }

  #choice(c: Body): void {
    const index = typeof c.index === 'number' ? c.index : 0
    let ch = this.#choices.get(index)
    if (!ch) {
      ch = { index, text: '', content: undefined, reasoning: undefined, role: undefined, toolCalls: [], logprobs: undefined, chatLogprobs: undefined, tokenIds: undefined, promptTokenIds: null, finish: null, stopReason: null }
      this.#choices.set(index, ch)
    }
    if (typeof c.text === 'string') ch.text += c.text
    if (c.finish_reason != null) ch.finish = c.finish_reason
    if (c.stop_reason != null) ch.stopReason = c.stop_reason
    if (Array.isArray(c.token_ids)) concat((ch.tokenIds ??= []), c.token_ids)
    if (c.prompt_token_ids != null) ch.promptTokenIds = c.prompt_token_ids
    const lp = c.logprobs
    if (isObject(lp)) {
      if (this.#chat) concat((ch.chatLogprobs ??= []), lp.content)
      else {
        ch.logprobs ??= { text_offset: [], token_logprobs: [], tokens: [], top_logprobs: [] }
        for (const k of ['text_offset', 'token_logprobs', 'tokens', 'top_logprobs'] as const) concat(ch.logprobs[k], lp[k])
      }
    }
    const d = c.delta
    if (!isObject(d)) return
    if (typeof d.role === 'string') ch.role = d.role
    if (typeof d.content === 'string') ch.content = (ch.content ?? '') + d.content
    const reasoning = d.reasoning ?? d.reasoning_content
    if (typeof reasoning === 'string') ch.reasoning = (ch.reasoning ?? '') + reasoning
    if (Array.isArray(d.tool_calls)) for (const t of d.tool_calls) if (isObject(t)) toolDelta(ch.toolCalls, t)
  }

  /** The non-streamed answer. */
  result(): Body {
    const head = this.#head ?? {}
    const choices = [...this.#choices.values()].sort((a, b) => a.index - b.index).map((c) => (this.#chat ? chatChoice(c) : completionChoice(c)))
    const out: Body = { id: head.id, object: this.#chat ? 'chat.completion' : 'text_completion', created: head.created, model: head.model, choices }
    if (this.#fingerprint !== undefined) out.system_fingerprint = this.#fingerprint
    out.usage = this.#usage
    if (this.#chat) {
      out.prompt_logprobs = null
      out.prompt_token_ids = [...this.#choices.values()].some((c) => c.tokenIds) ? this.#promptTokenIds : null
    }
    out.kv_transfer_params = null
    return out
  }
}

/** One tool call's delta into the calls so far (vLLM streams a call's arguments in pieces, by index). */
function toolDelta(calls: ToolCall[], t: Body): void {
  const i = typeof t.index === 'number' ? t.index : calls.length
  const call = (calls[i] ??= { function: { name: '', arguments: '' } })
  if (t.id != null) call.id = t.id
  if (t.type != null) call.type = t.type
  const f = t.function
  if (isObject(f)) {
    if (typeof f.name === 'string') call.function.name += f.name
    if (typeof f.arguments === 'string') call.function.arguments += f.arguments
  }
}

function completionChoice(c: Choice): Body {
  return {
    index: c.index,
    text: c.text,
    logprobs: c.logprobs ?? null,
    finish_reason: c.finish,
    stop_reason: c.stopReason,
    token_ids: c.tokenIds ?? null,
    prompt_logprobs: null,
    // vLLM streams them with echo too, but answers them whole only for return_token_ids.
    prompt_token_ids: c.tokenIds ? c.promptTokenIds : null,
  }
}

function chatChoice(c: Choice): Body {
  const message: Body = { role: c.role ?? 'assistant', content: c.content ?? null, refusal: null, reasoning: c.reasoning ?? null }
  if (c.toolCalls.length > 0) message.tool_calls = c.toolCalls.filter(Boolean).map((t) => ({ id: t.id, type: t.type ?? 'function', function: t.function }))
  return {
    index: c.index,
    message,
    logprobs: c.chatLogprobs ? { content: c.chatLogprobs } : null,
    finish_reason: c.finish,
    stop_reason: c.stopReason,
    token_ids: c.tokenIds ?? null,
  }
}

/**
 * Reads D's stream to its end and returns the assembled answer. `onFirstFrame` hears of the
 * first telling frame (past a chat role preamble) and may return an error to stop at it; an
 * error event from D throws StreamedError.
 */
export async function assembleStream(body: AsyncIterable<Buffer>, chat: boolean, onFirstFrame: (kind: 'data' | 'error') => Error | undefined): Promise<Body> {
  const asm = new AnswerAssembler(chat)
  let tail = ''
  let judged = false
  // A character's bytes may arrive in two reads.
  const utf8 = new StringDecoder('utf8')
  for await (const buf of body) {
    const { data, rest } = sseData(tail + utf8.write(buf))
    tail = rest
    for (const d of data) {
      if (d === '[DONE]') continue
      const chunk = JSON.parse(d) as unknown
      if (!isObject(chunk)) continue
      const verdict = judged ? undefined : verdictOf(chunk)
      if (verdict) {
        judged = true
        const stop = onFirstFrame(verdict)
        if (stop) throw stop
      }
      if ('error' in chunk) throw new StreamedError(d)
      asm.add(chunk)
    }
  }
  return asm.result()
}
