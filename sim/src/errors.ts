import { codedErrors, errorCodes } from '../../common/coded-error.js'

/*
 * The simulator's coded errors (SIM_ERR_*). Each carries its HTTP status; routes render them
 * as OpenAI error bodies whose `code` is this string (docs/errors.md, "## sim").
 */
export const simErrors = codedErrors({
  SIM_ERR_MODEL_NOT_FOUND: { status: 404, message: 'The model `%s` does not exist.' },
  SIM_ERR_PROMPT_TOO_LONG: {
    status: 400,
    message: "This model's maximum context length is %d tokens. However, your request has %d input tokens.",
  },
  SIM_ERR_MAX_TOKENS_TOO_LARGE: {
    status: 400,
    message: "This model's maximum context length is %d tokens. However, you requested %d output tokens and your prompt contains %d input tokens.",
  },
  SIM_ERR_NUM_TOKENS_MISMATCH: {
    status: 400,
    message: 'kv_transfer_params.remote_num_tokens is %d but this prompt has %d tokens: the prefill and decode legs carried different prompts',
  },
  SIM_ERR_UNSUPPORTED_PROMPT: { status: 400, message: 'The simulator does not support %s' },
  SIM_ERR_DUPLICATE_REQUEST_ID: { status: 400, message: 'Request id %s is already running on this engine (X-Request-Id reused while in flight)' },
  SIM_ERR_BAD_REQUEST: { status: 400, message: '%s' },
  SIM_ERR_KV_CAPACITY: { status: 503, message: 'Not enough free KV blocks: %d needed, %d free' },
  SIM_ERR_UNAUTHORIZED: { status: 401, message: 'Unauthorized' },
  SIM_ERR_NOT_FOUND: { status: 404, message: 'Route %s %s not found' },
  SIM_ERR_INTERNAL: { status: 500, message: 'Internal error: %s' },
  SIM_ERR_INJECTED: { status: 500, message: 'Injected fault: internal server error' },
  SIM_ERR_SHUTTING_DOWN: { status: 503, message: 'The simulator is shutting down' },
  SIM_ERR_INVALID_CONFIG: { status: 500, message: 'Invalid simulator configuration: %s' },
  // A call to the transfer agent failed: the agent's error code (or the socket's) is on the
  // error as `agentCode`, with `agentStatus`, `invalidBlockIds` and `tainted` when it answered.
  SIM_ERR_AGENT_CALL: { status: 502, message: 'Transfer agent call failed: %s' },
  SIM_ERR_AGENT_NOT_READY: { status: 503, message: 'Not attached to the transfer agent yet: %s' },
  SIM_ERR_KV_LEASE_FAILED: { status: 500, message: 'Cannot lease the KV blocks of %s: %s' },
  SIM_ERR_KV_LOAD_FAILED: { status: 500, message: 'KV load failed (kv_load_failure_policy=fail): %s' },
})

export const {
  SIM_ERR_MODEL_NOT_FOUND,
  SIM_ERR_PROMPT_TOO_LONG,
  SIM_ERR_MAX_TOKENS_TOO_LARGE,
  SIM_ERR_NUM_TOKENS_MISMATCH,
  SIM_ERR_UNSUPPORTED_PROMPT,
  SIM_ERR_DUPLICATE_REQUEST_ID,
  SIM_ERR_BAD_REQUEST,
  SIM_ERR_KV_CAPACITY,
  SIM_ERR_UNAUTHORIZED,
  SIM_ERR_NOT_FOUND,
  SIM_ERR_INTERNAL,
  SIM_ERR_INJECTED,
  SIM_ERR_SHUTTING_DOWN,
  SIM_ERR_INVALID_CONFIG,
  SIM_ERR_AGENT_CALL,
  SIM_ERR_AGENT_NOT_READY,
  SIM_ERR_KV_LEASE_FAILED,
  SIM_ERR_KV_LOAD_FAILED,
} = simErrors

/** Every code, for the consistency test against docs/errors.md. */
export const SIM_ERROR_CODES: readonly string[] = Object.freeze(errorCodes(simErrors))
