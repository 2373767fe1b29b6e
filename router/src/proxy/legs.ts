import type { IncomingHttpHeaders } from 'node:http'
import { PREFILL_REQUEST_PARAMS } from '../../../schemas/kv-transfer-params.js'
import type { BodyView } from './shared-body.js'

type Body = Record<string, unknown>

/** Client options the prefill leg drops (see prefillBody). */
const PREFILL_DROPPED = ['stream_options', 'min_tokens', 'min_completion_tokens', 'stop', 'stop_token_ids', 'best_of'] as const

/** What the prefill leg sets, in this order (appended where the client did not send them). */
function prefillFields(get: (key: string) => unknown): Body {
  const out: Body = { kv_transfer_params: { ...PREFILL_REQUEST_PARAMS }, stream: false, max_tokens: 1, ignore_eos: true, n: 1 }
  const mct = get('max_completion_tokens')
  if (mct !== undefined && mct !== null) out.max_completion_tokens = 1
  return out
}

/** Every member a leg may change: SharedBody serialises the others once for all legs. */
export const LEG_MEMBERS: readonly string[] = ['kv_transfer_params', 'stream', 'max_tokens', 'ignore_eos', 'n', 'max_completion_tokens', 'vllm_xargs', 'prompt_logprobs', ...PREFILL_DROPPED]

/**
 * The prefill leg's body (protocol reference §1.2, §8 item 1): the client's body with
 * `do_remote_decode`, non-streamed, one token, and forced to finish by length. vLLM's
 * connector returns kv_transfer_params only for a length finish: a client `stop`,
 * `stop_token_ids` or an EOS sampled as the one token would finish P by stop, and D would
 * silently prefill again. So EOS is ignored, stop criteria are cleared, min tokens are
 * dropped (0) and one choice is asked for. D gets the client's own settings back.
 */
export function prefillBody(body: Body): Body {
  const rest = { ...withoutClientParams(body) }
  for (const k of PREFILL_DROPPED) delete rest[k]
  return { ...rest, ...prefillFields((k) => body[k]) }
}

/** prefillBody on a view of a body already without client params (clientView). */
export function prefillView(view: BodyView): BodyView {
  return view.without(PREFILL_DROPPED).with(prefillFields((k) => view.get(k)))
}

/**
 * The decode leg's body (§1.4): the client's original body with P's `kv_transfer_params`
 * verbatim, never rebuilt field by field. Without params D prefills locally.
 */
export function decodeBody(body: Body, params: Record<string, unknown> | undefined): Body {
  const own = withoutClientParams(body)
  return params === undefined ? own : { ...own, kv_transfer_params: params }
}

/** decodeBody on a view of a body already without client params (clientView). */
export function decodeView(view: BodyView, params: Record<string, unknown> | undefined): BodyView {
  return params === undefined ? view : view.without(['kv_transfer_params']).with({ kv_transfer_params: params })
}

/**
 * A non-streamed request's decode leg, streamed from D with usage (leases.readCheck
 * `router`): the router must see D's first token to judge its read (assemble.ts). vLLM
 * refuses prompt_logprobs on a stream; D never computed the prompt anyway, P's are merged.
 */
export function streamedDecodeView(view: BodyView): BodyView {
  return view.without(['prompt_logprobs']).with({ stream: true, stream_options: { include_usage: true } })
}

/**
 * The body without any kv_transfer_params the client sent: at the top level, and inside
 * `vllm_xargs`, which vLLM copies into SamplingParams.extra_args where its connector reads
 * kv_transfer_params too (issue 18): either would let a client name the host D reads from.
 * The same object when there is nothing to drop.
 */
export function withoutClientParams(body: Body): Body {
  const xargs = body.vllm_xargs
  const inXargs = typeof xargs === 'object' && xargs !== null && !Array.isArray(xargs) && 'kv_transfer_params' in xargs
  if (body.kv_transfer_params === undefined && !inXargs) return body
  const { kv_transfer_params: _k, ...rest } = body
  if (inXargs) {
    const { kv_transfer_params: _x, ...others } = xargs as Body
    rest.vllm_xargs = others
  }
  return rest
}

/** Whether a route is the chat API (its request and answer shapes differ from completions'). */
export function isChatPath(path: string): boolean {
  return path.endsWith('/chat/completions')
}

/** Whether the client asked for a streamed answer. */
export function wantsStream(body: Body): boolean {
  return body.stream === true
}

/**
 * Client headers both legs carry as they came: W3C trace context (vLLM continues the trace
 * with --otlp-traces-endpoint) and vLLM's per-request routing headers, session affinity and
 * priority. Not X-data-parallel-rank: P and D are separate deployments whose DP ranks need
 * not match. Not X-Request-Id: each handoff has its own engine request id.
 */
export const FORWARDED_HEADERS = ['traceparent', 'tracestate', 'x-session-id', 'x-vllm-priority'] as const

/** The FORWARDED_HEADERS a client sent (the last value of a repeated one). */
export function forwardedHeaders(headers: IncomingHttpHeaders): Record<string, string> {
  const out: Record<string, string> = {}
  for (const name of FORWARDED_HEADERS) {
    const v = headers[name]
    const value = Array.isArray(v) ? v.at(-1) : v
    if (value !== undefined) out[name] = value
  }
  return out
}
