/**
 * Cross-field rules vLLM 0.32 enforces on a completion or chat request before it runs
 * (entrypoints/openai/*\/protocol.py, its `mode="before"` validators), with vLLM's own
 * messages. The router applies them before the prefill leg: the prefill body drops
 * `stream_options` and sets `stream: false`, so P accepts such a request, spends a full
 * prefill and holds KV under a lease, and only D refuses it. The simulator applies them as
 * vLLM does.
 */
export interface RequestProblem {
  message: string
  param: string
}

type Body = Record<string, unknown>

/** The first rule `body` breaks, or undefined. `chat`: top_logprobs is the chat API's count. */
export function vllmRequestProblem(body: Body, chat: boolean): RequestProblem | undefined {
  if (body.stream_options && !body.stream) {
    return { message: 'Stream options can only be defined when `stream=True`.', param: 'stream_options' }
  }
  for (const param of ['prompt_logprobs', chat ? 'top_logprobs' : 'logprobs']) {
    const v = body[param]
    if (v === undefined || v === null) continue
    if (typeof v !== 'number') return { message: `\`${param}\` must be an integer.`, param }
    if (param === 'prompt_logprobs' && body.stream && (v > 0 || v === -1)) {
      return { message: '`prompt_logprobs` are not available when `stream=True`.', param }
    }
    if (v < 0 && v !== -1) return { message: `\`${param}\` must be a positive value or -1.`, param }
  }
  return undefined
}
