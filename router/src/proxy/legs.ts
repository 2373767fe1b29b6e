import { PREFILL_REQUEST_PARAMS } from '../../../schemas/kv-transfer-params.js'

type Body = Record<string, unknown>

/**
 * The prefill leg's body (protocol reference §1.2, §8 item 1): the client's body with
 * `do_remote_decode`, non-streamed, one token, and forced to finish by length. vLLM's
 * connector returns kv_transfer_params only for a length finish: a client `stop`,
 * `stop_token_ids` or an EOS sampled as the one token would finish P by stop, and D would
 * silently prefill again. So EOS is ignored, stop criteria are cleared, min tokens are
 * dropped (0) and one choice is asked for. D gets the client's own settings back.
 */
export function prefillBody(body: Body): Body {
  const {
    stream_options: _so,
    min_tokens: _mt,
    min_completion_tokens: _mct,
    stop: _stop,
    stop_token_ids: _sti,
    best_of: _bo,
    ...rest
  } = withoutClientParams(body)
  const out: Body = { ...rest, kv_transfer_params: { ...PREFILL_REQUEST_PARAMS }, stream: false, max_tokens: 1, ignore_eos: true, n: 1 }
  if (body.max_completion_tokens !== undefined && body.max_completion_tokens !== null) out.max_completion_tokens = 1
  return out
}

/**
 * The decode leg's body (§1.4): the client's original body with P's `kv_transfer_params`
 * verbatim, never rebuilt field by field. Without params D prefills locally.
 */
export function decodeBody(body: Body, params: Record<string, unknown> | undefined): Body {
  const own = withoutClientParams(body)
  return params === undefined ? own : { ...own, kv_transfer_params: params }
}

/**
 * The body without any kv_transfer_params the client sent: at the top level, and inside
 * `vllm_xargs`, which vLLM copies into SamplingParams.extra_args where its connector reads
 * kv_transfer_params too (issue 18): either would let a client name the host D reads from.
 * The same object when there is nothing to drop.
 */
function withoutClientParams(body: Body): Body {
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

/** Whether the client asked for a streamed answer. */
export function wantsStream(body: Body): boolean {
  return body.stream === true
}
