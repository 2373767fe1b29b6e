import createError from '@fastify/error'

/*
 * The simulator's coded errors (SIM_ERR_*). Each carries its HTTP status; routes render them
 * as OpenAI error bodies whose `code` is this string (docs/errors.md, "## sim").
 */

export const SimModelNotFoundError = createError<[string]>('SIM_ERR_MODEL_NOT_FOUND', 'The model `%s` does not exist.', 404)
export const SimPromptTooLongError = createError<[number, number]>(
  'SIM_ERR_PROMPT_TOO_LONG',
  "This model's maximum context length is %d tokens. However, your request has %d input tokens.",
  400,
)
export const SimMaxTokensTooLargeError = createError<[number, number, number]>(
  'SIM_ERR_MAX_TOKENS_TOO_LARGE',
  "This model's maximum context length is %d tokens. However, you requested %d output tokens and your prompt contains %d input tokens.",
  400,
)
export const SimNumTokensMismatchError = createError<[number, number]>(
  'SIM_ERR_NUM_TOKENS_MISMATCH',
  'kv_transfer_params.remote_num_tokens is %d but this prompt has %d tokens: the prefill and decode legs carried different prompts',
  400,
)
export const SimUnsupportedPromptError = createError<[string]>('SIM_ERR_UNSUPPORTED_PROMPT', 'The simulator does not support %s', 400)
export const SimDuplicateRequestIdError = createError<[string]>(
  'SIM_ERR_DUPLICATE_REQUEST_ID',
  'Request id %s is already running on this engine (X-Request-Id reused while in flight)',
  400,
)
export const SimBadRequestError = createError<[string]>('SIM_ERR_BAD_REQUEST', '%s', 400)
export const SimKvCapacityError = createError<[number, number]>(
  'SIM_ERR_KV_CAPACITY',
  'Not enough free KV blocks: %d needed, %d free',
  503,
)
export const SimUnauthorizedError = createError('SIM_ERR_UNAUTHORIZED', 'Unauthorized', 401)
export const SimNotFoundError = createError<[string, string]>('SIM_ERR_NOT_FOUND', 'Route %s %s not found', 404)
export const SimInternalError = createError<[string]>('SIM_ERR_INTERNAL', 'Internal error: %s', 500)
export const SimInjectedError = createError('SIM_ERR_INJECTED', 'Injected fault: internal server error', 500)
export const SimShuttingDownError = createError('SIM_ERR_SHUTTING_DOWN', 'The simulator is shutting down', 503)
export const SimInvalidConfigError = createError<[string]>('SIM_ERR_INVALID_CONFIG', 'Invalid simulator configuration: %s', 500)
export const SimKvModeUnsupportedError = createError<[string]>(
  'SIM_ERR_KV_MODE_UNSUPPORTED',
  '--kv %s is not implemented yet (it arrives with the transfer agent); use --kv none',
  500,
)

/** Every code, for the consistency test against docs/errors.md. */
export const SIM_ERROR_CODES: readonly string[] = Object.freeze([
  'SIM_ERR_MODEL_NOT_FOUND',
  'SIM_ERR_PROMPT_TOO_LONG',
  'SIM_ERR_MAX_TOKENS_TOO_LARGE',
  'SIM_ERR_NUM_TOKENS_MISMATCH',
  'SIM_ERR_UNSUPPORTED_PROMPT',
  'SIM_ERR_DUPLICATE_REQUEST_ID',
  'SIM_ERR_BAD_REQUEST',
  'SIM_ERR_KV_CAPACITY',
  'SIM_ERR_UNAUTHORIZED',
  'SIM_ERR_NOT_FOUND',
  'SIM_ERR_INTERNAL',
  'SIM_ERR_INJECTED',
  'SIM_ERR_SHUTTING_DOWN',
  'SIM_ERR_INVALID_CONFIG',
  'SIM_ERR_KV_MODE_UNSUPPORTED',
])
