import {
  RTR_ERR_UPSTREAM_BAD_RESPONSE,
  RTR_ERR_UPSTREAM_RESET,
  RTR_ERR_UPSTREAM_STATUS,
  RTR_ERR_UPSTREAM_TIMEOUT,
  RTR_ERR_UPSTREAM_UNAVAILABLE,
  type CodedError,
  type RouterErrorCode,
} from '../errors.js'

export type Leg = 'prefill' | 'decode' | 'single'

/** What went wrong talking to an engine, before it is mapped to a client-facing error. */
export type UpstreamFailure =
  | { kind: 'transport'; cause: unknown }
  | { kind: 'status'; status: number; detail: string }
  | { kind: 'bad-response'; detail: string; cause?: unknown }

const UNAVAILABLE = new Set(['ECONNREFUSED', 'ENOTFOUND', 'EAI_AGAIN', 'EHOSTUNREACH', 'ENETUNREACH', 'UND_ERR_CONNECT_TIMEOUT'])
const TIMEOUT = new Set(['UND_ERR_HEADERS_TIMEOUT', 'UND_ERR_BODY_TIMEOUT', 'ETIMEDOUT'])

function causeCode(err: unknown): string | undefined {
  // undici wraps socket errors; the errno code may sit one level down.
  for (let e = err, depth = 0; e && depth < 4; e = (e as { cause?: unknown }).cause, depth++) {
    const code = (e as { code?: unknown }).code
    if (typeof code === 'string' && (UNAVAILABLE.has(code) || TIMEOUT.has(code))) return code
  }
  return (err as { code?: string } | undefined)?.code
}

/**
 * The one place that turns an upstream failure into a router error: unreachable → 503,
 * too slow → 504, reset or bad answer → 502, each with its own code. `instance` is the
 * instance id (never its URL, which clients need not see).
 */
export function mapUpstreamFailure(failure: UpstreamFailure, leg: Leg, instance: string): CodedError & { code: RouterErrorCode } {
  switch (failure.kind) {
    case 'status':
      return new RTR_ERR_UPSTREAM_STATUS(leg, instance, failure.status, failure.detail)
    case 'bad-response':
      return new RTR_ERR_UPSTREAM_BAD_RESPONSE(leg, instance, failure.detail, { cause: failure.cause })
    case 'transport': {
      const code = causeCode(failure.cause)
      if (code && UNAVAILABLE.has(code)) return new RTR_ERR_UPSTREAM_UNAVAILABLE(leg, instance, { cause: failure.cause })
      if (code && TIMEOUT.has(code)) return new RTR_ERR_UPSTREAM_TIMEOUT(leg, instance, { cause: failure.cause })
      return new RTR_ERR_UPSTREAM_RESET(leg, instance, { cause: failure.cause })
    }
  }
}

/**
 * True when the request never reached the engine: the connection was refused or could not be
 * made. Only this counts against an instance's health (a slow answer, a long generation or an
 * engine's 5xx for a bad input says nothing about it), and only this may be retried on another
 * instance, since the engine cannot have started the work.
 */
export function isConnectFailure(err: CodedError): boolean {
  return err.code === 'RTR_ERR_UPSTREAM_UNAVAILABLE'
}

/** Pulls an engine's error message out of an OpenAI/vLLM error body, if there is one. */
export function upstreamErrorDetail(text: string): string {
  try {
    const parsed = JSON.parse(text) as { error?: { message?: unknown; code?: unknown }; message?: unknown }
    const msg = parsed.error?.message ?? parsed.message
    // vLLM's `code` is the HTTP status (a number); a string code names the failure: keep it.
    const code = parsed.error?.code
    if (typeof msg === 'string') return (typeof code === 'string' ? `${code}: ${msg}` : msg).slice(0, 500)
  } catch {
    // Not JSON: fall through to the raw text.
  }
  return text.slice(0, 200) || '(empty body)'
}
