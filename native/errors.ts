import createError from '@fastify/error'

/**
 * Coded errors of the native addon (`NAT_ERR_*`). Callers branch on `err.code`; the message
 * is for people. Errors that come from a NIXL call also carry the raw C status
 * (`nixlStatus`, a `nixl_capi_status_t` value, not the C++ `nixl_status_t`) and the name of
 * the call (`nixlOp`), and chain the addon's original error as `cause`.
 * The table is mirrored in docs/errors.md, section "native (NAT_ERR_*)".
 */
export interface NativeErrorDetails {
  nixlStatus?: number
  nixlOp?: string
  peer?: string
}

type Args = [detail: string, options?: { cause?: unknown }]

function coded<C extends string, S extends number>(code: C, message: string, statusCode: S) {
  return createError<C, S, Args>(code, message, statusCode)
}

// The HTTP-ish status says how a service should surface the failure: 503 for "not here",
// 502 for a peer or library fault, 504 for a deadline, 400/409 for caller mistakes.
export const NAT_ERR_ADDON_MISSING = coded('NAT_ERR_ADDON_MISSING', 'native addon not built: %s', 503)
export const NAT_ERR_NIXL_NOT_AVAILABLE = coded('NAT_ERR_NIXL_NOT_AVAILABLE', 'NIXL not available: %s', 503)
export const NAT_ERR_NIXL_SYMBOL_MISSING = coded('NAT_ERR_NIXL_SYMBOL_MISSING', 'NIXL C API incomplete: %s', 503)
export const NAT_ERR_NIXL_STUB = coded('NAT_ERR_NIXL_STUB', 'NIXL stub library refused: %s', 503)
export const NAT_ERR_ALREADY_LOADED = coded('NAT_ERR_ALREADY_LOADED', 'a different NIXL is already loaded: %s', 409)
export const NAT_ERR_PLUGIN_MISSING = coded('NAT_ERR_PLUGIN_MISSING', 'NIXL plugin missing: %s', 503)
export const NAT_ERR_BACKEND_CREATE = coded('NAT_ERR_BACKEND_CREATE', 'NIXL backend creation failed: %s', 503)
export const NAT_ERR_INVALID_ARG = coded('NAT_ERR_INVALID_ARG', 'invalid argument: %s', 400)
export const NAT_ERR_AGENT_CLOSED = coded('NAT_ERR_AGENT_CLOSED', 'NIXL agent closed: %s', 409)
export const NAT_ERR_REGISTER = coded('NAT_ERR_REGISTER', 'memory registration failed: %s', 500)
export const NAT_ERR_DEREGISTER = coded('NAT_ERR_DEREGISTER', 'memory deregistration failed: %s', 500)
export const NAT_ERR_METADATA_REJECTED = coded('NAT_ERR_METADATA_REJECTED', 'remote metadata rejected: %s', 502)
export const NAT_ERR_PEER_UNKNOWN = coded('NAT_ERR_PEER_UNKNOWN', 'peer not loaded: %s', 409)
export const NAT_ERR_PEER_GONE = coded('NAT_ERR_PEER_GONE', 'peer forgotten: %s', 410)
export const NAT_ERR_PEER_BUSY = coded('NAT_ERR_PEER_BUSY', 'peer has reads in flight: %s', 409)
export const NAT_ERR_MEMORY_IN_USE = coded('NAT_ERR_MEMORY_IN_USE', 'memory in use by a transfer: %s', 409)
export const NAT_ERR_REMOTE_DISCONNECT = coded('NAT_ERR_REMOTE_DISCONNECT', 'peer disconnected: %s', 502)
export const NAT_ERR_XFER_TIMEOUT = coded('NAT_ERR_XFER_TIMEOUT', 'transfer deadline passed: %s', 504)
export const NAT_ERR_XFER_CANCELED = coded('NAT_ERR_XFER_CANCELED', 'transfer canceled: %s', 499)
export const NAT_ERR_XFER_TAINTED = coded('NAT_ERR_XFER_TAINTED', 'aborted transfer not yet quiescent: %s', 502)
export const NAT_ERR_NIXL_INVALID_PARAM = coded('NAT_ERR_NIXL_INVALID_PARAM', 'NIXL rejected a parameter: %s', 400)
export const NAT_ERR_NIXL_BACKEND = coded('NAT_ERR_NIXL_BACKEND', 'NIXL backend error: %s', 502)
export const NAT_ERR_NIXL_INVALID_STATE = coded('NAT_ERR_NIXL_INVALID_STATE', 'NIXL invalid state: %s', 500)
export const NAT_ERR_NIXL_EXCEPTION = coded('NAT_ERR_NIXL_EXCEPTION', 'NIXL raised an exception: %s', 500)
export const NAT_ERR_NIXL_NOT_FOUND = coded('NAT_ERR_NIXL_NOT_FOUND', 'NIXL found nothing to serve the call: %s', 404)
export const NAT_ERR_NIXL_UNKNOWN_STATUS = coded('NAT_ERR_NIXL_UNKNOWN_STATUS', 'NIXL returned an unknown status: %s', 502)
export const NAT_ERR_SHM = coded('NAT_ERR_SHM', 'shared memory failure: %s', 500)

/** Every constructor by code, so a code coming back from C++ finds its class. */
export const nativeErrors = {
  NAT_ERR_ADDON_MISSING,
  NAT_ERR_NIXL_NOT_AVAILABLE,
  NAT_ERR_NIXL_SYMBOL_MISSING,
  NAT_ERR_NIXL_STUB,
  NAT_ERR_ALREADY_LOADED,
  NAT_ERR_PLUGIN_MISSING,
  NAT_ERR_BACKEND_CREATE,
  NAT_ERR_INVALID_ARG,
  NAT_ERR_AGENT_CLOSED,
  NAT_ERR_REGISTER,
  NAT_ERR_DEREGISTER,
  NAT_ERR_METADATA_REJECTED,
  NAT_ERR_PEER_UNKNOWN,
  NAT_ERR_PEER_GONE,
  NAT_ERR_PEER_BUSY,
  NAT_ERR_MEMORY_IN_USE,
  NAT_ERR_REMOTE_DISCONNECT,
  NAT_ERR_XFER_TIMEOUT,
  NAT_ERR_XFER_CANCELED,
  NAT_ERR_XFER_TAINTED,
  NAT_ERR_NIXL_INVALID_PARAM,
  NAT_ERR_NIXL_BACKEND,
  NAT_ERR_NIXL_INVALID_STATE,
  NAT_ERR_NIXL_EXCEPTION,
  NAT_ERR_NIXL_NOT_FOUND,
  NAT_ERR_NIXL_UNKNOWN_STATUS,
  NAT_ERR_SHM,
} as const

export type NativeErrorCode = keyof typeof nativeErrors

export type NativeError = createError.FastifyError & NativeErrorDetails & { code: NativeErrorCode }

export function isNativeErrorCode(code: unknown): code is NativeErrorCode {
  return typeof code === 'string' && Object.hasOwn(nativeErrors, code)
}

/** Builds a coded error, attaching the NIXL details when there are any. */
export function nativeError(
  code: NativeErrorCode,
  detail: string,
  extra: NativeErrorDetails & { cause?: unknown } = {},
): NativeError {
  const Ctor = nativeErrors[code]
  const err: NativeError = extra.cause === undefined ? new Ctor(detail) : new Ctor(detail, { cause: extra.cause })
  if (extra.nixlStatus !== undefined) err.nixlStatus = extra.nixlStatus
  if (extra.nixlOp !== undefined) err.nixlOp = extra.nixlOp
  if (extra.peer !== undefined) err.peer = extra.peer
  return err
}

function field<T extends 'string' | 'number'>(o: object, key: string, type: T): (T extends 'string' ? string : number) | undefined {
  const v: unknown = (o as Record<string, unknown>)[key]
  return typeof v === type ? (v as T extends 'string' ? string : number) : undefined
}

/**
 * The one place where errors from the `.node` file become coded errors. The addon rejects
 * with plain Errors carrying `code`, `nixlStatus`, `nixlOp` and `peer`; anything without a
 * known code (a bug) becomes NAT_ERR_NIXL_EXCEPTION so callers still get a code.
 */
export function fromNative(raw: unknown): NativeError {
  if (raw instanceof Error && isNativeErrorCode(field(raw, 'code', 'string'))) {
    // Already one of ours (the gate itself threw it): keep it as is.
    if (Reflect.get(raw, Symbol.for('fastify-error-generic')) === true) return raw as NativeError
    const code = field(raw, 'code', 'string') as NativeErrorCode
    return nativeError(code, raw.message, {
      cause: raw,
      nixlStatus: field(raw, 'nixlStatus', 'number'),
      nixlOp: field(raw, 'nixlOp', 'string'),
      peer: field(raw, 'peer', 'string'),
    })
  }
  const message = raw instanceof Error ? raw.message : String(raw)
  return nativeError('NAT_ERR_NIXL_EXCEPTION', message, { cause: raw })
}
