import { codedErrors, isTableError } from '../../common/coded-error.js'
import type { ErrorBody } from '../../schemas/openai.js'

/**
 * Every failure the router reports, one coded constructor each, built by the factory all
 * packages share. Callers branch on `err.code`, never on text. `type` is OpenAI's error
 * class, used in the client-facing body. docs/errors.md lists every code; a test keeps the
 * two in step.
 */
interface ErrorSpec {
  status: number
  type: 'invalid_request_error' | 'authentication_error' | 'not_found_error' | 'server_error' | 'upstream_error'
  message: string
}

export const errorSpecs = {
  RTR_ERR_INVALID_JSON: { status: 400, type: 'invalid_request_error', message: 'request body is not valid JSON: %s' },
  RTR_ERR_INVALID_REQUEST: { status: 400, type: 'invalid_request_error', message: 'invalid request: %s' },
  RTR_ERR_UNSUPPORTED_MEDIA_TYPE: { status: 415, type: 'invalid_request_error', message: 'content type %s is not supported; send application/json' },
  RTR_ERR_BODY_TOO_LARGE: { status: 413, type: 'invalid_request_error', message: 'request body exceeds the limit of %s bytes' },
  RTR_ERR_UNSUPPORTED: { status: 400, type: 'invalid_request_error', message: '%s' },
  RTR_ERR_TOO_MANY_HANDOFFS: { status: 400, type: 'invalid_request_error', message: 'the request needs %s handoffs (prompts × n), more than limits.maxHandoffsPerRequest (%s)' },
  RTR_ERR_UNAUTHORIZED: { status: 401, type: 'authentication_error', message: 'a valid API key is required (Authorization: Bearer <key>)' },
  RTR_ERR_ADMIN_UNAUTHORIZED: { status: 401, type: 'authentication_error', message: 'control endpoints need the admin token (Authorization: Bearer <admin token>)' },
  RTR_ERR_ADMIN_DISABLED: { status: 403, type: 'authentication_error', message: 'control endpoints are disabled: the router has no admin token (adminToken, HANDOFF_ADMIN_TOKEN)' },
  RTR_ERR_AGENT_UNAUTHORIZED: { status: 401, type: 'authentication_error', message: 'agent endpoints need the agent token (Authorization: Bearer <agent token>)' },
  RTR_ERR_AGENT_UNKNOWN: { status: 404, type: 'not_found_error', message: 'agent %s is not registered' },
  RTR_ERR_TOO_MANY_AGENTS: { status: 503, type: 'server_error', message: 'the agent directory is full: it holds limits.maxAgents (%s) agents, so agent %s is not taken' },
  RTR_ERR_EVENT_NOT_FOUND: { status: 404, type: 'not_found_error', message: 'event %s is not held (never logged, or past retention: the log holds %s)' },
  RTR_ERR_EVENT_OTHER_LOG: { status: 410, type: 'not_found_error', message: 'event %s of log %s: that log is gone (Redis lost it, or the router restarted in memory); the log is now %s, and its sequences are other events' },
  RTR_ERR_MODEL_NOT_FOUND: { status: 404, type: 'not_found_error', message: 'the model `%s` does not exist' },
  RTR_ERR_ROUTE_NOT_FOUND: { status: 404, type: 'not_found_error', message: 'route %s not found' },
  RTR_ERR_NO_INSTANCE: { status: 503, type: 'server_error', message: 'no healthy instance can serve model `%s`' },
  RTR_ERR_SHUTTING_DOWN: { status: 503, type: 'server_error', message: 'the router is shutting down' },
  RTR_ERR_STORE_UNAVAILABLE: { status: 503, type: 'server_error', message: 'the shared store (Redis) is unreachable, so this change cannot be recorded for the other routers (%s); routing continues from the last topology; retry' },
  RTR_ERR_OVERLOADED: { status: 429, type: 'server_error', message: 'every instance that serves model `%s` is at its concurrency cap and %s; retry after %s s' },
  RTR_ERR_LEASE_LAPSED: { status: 503, type: 'server_error', message: 'the KV lease for this request was too close to its expiry to start the decode leg (%s); retry' },
  RTR_ERR_LATE_READ: { status: 503, type: 'server_error', message: 'decode instance %s began its answer after the KV lease ran out (%s): its read of the prompt\'s KV may have found blocks the prefiller had already reused, so the answer was withheld; retry' },
  RTR_ERR_INSTANCE_EXISTS: { status: 409, type: 'invalid_request_error', message: 'instance %s is already in the topology' },
  RTR_ERR_INSTANCE_NOT_FOUND: { status: 404, type: 'not_found_error', message: 'instance %s is not in the topology' },
  RTR_ERR_UPSTREAM_UNAVAILABLE: { status: 503, type: 'upstream_error', message: '%s instance %s is unreachable' },
  RTR_ERR_UPSTREAM_TIMEOUT: { status: 504, type: 'upstream_error', message: '%s instance %s did not answer in time' },
  RTR_ERR_UPSTREAM_RESET: { status: 502, type: 'upstream_error', message: '%s instance %s closed the connection' },
  RTR_ERR_UPSTREAM_BAD_RESPONSE: { status: 502, type: 'upstream_error', message: '%s instance %s sent an invalid response: %s' },
  RTR_ERR_UPSTREAM_STATUS: { status: 502, type: 'upstream_error', message: '%s instance %s failed with HTTP %s: %s' },
  RTR_ERR_CONFIG: { status: 500, type: 'server_error', message: 'invalid router configuration: %s' },
  RTR_ERR_INTERNAL: { status: 500, type: 'server_error', message: 'internal error: %s' },
} as const satisfies Record<string, ErrorSpec>

export type RouterErrorCode = keyof typeof errorSpecs

/** The constructors, one per code; the export names equal the codes (common/coded-error.ts). */
export const routerErrors = codedErrors(errorSpecs)

export const {
  RTR_ERR_INVALID_JSON,
  RTR_ERR_INVALID_REQUEST,
  RTR_ERR_UNSUPPORTED_MEDIA_TYPE,
  RTR_ERR_BODY_TOO_LARGE,
  RTR_ERR_UNSUPPORTED,
  RTR_ERR_TOO_MANY_HANDOFFS,
  RTR_ERR_UNAUTHORIZED,
  RTR_ERR_ADMIN_UNAUTHORIZED,
  RTR_ERR_ADMIN_DISABLED,
  RTR_ERR_AGENT_UNAUTHORIZED,
  RTR_ERR_AGENT_UNKNOWN,
  RTR_ERR_TOO_MANY_AGENTS,
  RTR_ERR_EVENT_NOT_FOUND,
  RTR_ERR_EVENT_OTHER_LOG,
  RTR_ERR_MODEL_NOT_FOUND,
  RTR_ERR_ROUTE_NOT_FOUND,
  RTR_ERR_NO_INSTANCE,
  RTR_ERR_SHUTTING_DOWN,
  RTR_ERR_STORE_UNAVAILABLE,
  RTR_ERR_OVERLOADED,
  RTR_ERR_LEASE_LAPSED,
  RTR_ERR_LATE_READ,
  RTR_ERR_INSTANCE_EXISTS,
  RTR_ERR_INSTANCE_NOT_FOUND,
  RTR_ERR_UPSTREAM_UNAVAILABLE,
  RTR_ERR_UPSTREAM_TIMEOUT,
  RTR_ERR_UPSTREAM_RESET,
  RTR_ERR_UPSTREAM_BAD_RESPONSE,
  RTR_ERR_UPSTREAM_STATUS,
  RTR_ERR_CONFIG,
  RTR_ERR_INTERNAL,
} = routerErrors

export interface CodedError extends Error {
  code: string
  statusCode?: number
}

export function isRouterError(err: unknown): err is CodedError & { code: RouterErrorCode } {
  return isTableError(routerErrors, err)
}

/** The OpenAI-shaped body for a router error. */
export function errorBody(err: CodedError & { code: RouterErrorCode }, param: string | null = null): ErrorBody {
  return { error: { message: err.message, type: errorSpecs[err.code].type, param, code: err.code } }
}

/** The SSE frame that ends a stream whose headers are already sent. */
export function errorEvent(err: CodedError & { code: RouterErrorCode }): string {
  return `data: ${JSON.stringify(errorBody(err))}\n\ndata: [DONE]\n\n`
}
