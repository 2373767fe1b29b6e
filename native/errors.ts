import type createError from '@fastify/error'
import { codedErrorsWith, errorWithDetails } from '../common/coded-error.js'

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

// The HTTP-ish status says how a service should surface the failure: 503 for "not here",
// 502 for a peer or library fault, 504 for a deadline, 400/409 for caller mistakes.
/** Every constructor by code (the shared factory, common/coded-error.ts), so a code coming back from C++ finds its class. */
export const nativeErrors = codedErrorsWith<Args>()({
  NAT_ERR_ADDON_MISSING: { status: 503, message: 'native addon not built: %s' },
  NAT_ERR_NIXL_NOT_AVAILABLE: { status: 503, message: 'NIXL not available: %s' },
  NAT_ERR_NIXL_SYMBOL_MISSING: { status: 503, message: 'NIXL C API incomplete: %s' },
  NAT_ERR_NIXL_STUB: { status: 503, message: 'NIXL stub library refused: %s' },
  NAT_ERR_ALREADY_LOADED: { status: 409, message: 'a different NIXL is already loaded: %s' },
  NAT_ERR_PLUGIN_MISSING: { status: 503, message: 'NIXL plugin missing: %s' },
  NAT_ERR_BACKEND_CREATE: { status: 503, message: 'NIXL backend creation failed: %s' },
  NAT_ERR_INVALID_ARG: { status: 400, message: 'invalid argument: %s' },
  NAT_ERR_AGENT_CLOSED: { status: 409, message: 'NIXL agent closed: %s' },
  NAT_ERR_REGISTER: { status: 500, message: 'memory registration failed: %s' },
  NAT_ERR_DEREGISTER: { status: 500, message: 'memory deregistration failed: %s' },
  NAT_ERR_METADATA_REJECTED: { status: 502, message: 'remote metadata rejected: %s' },
  NAT_ERR_PEER_UNKNOWN: { status: 409, message: 'peer not loaded: %s' },
  NAT_ERR_PEER_GONE: { status: 410, message: 'peer forgotten: %s' },
  NAT_ERR_PEER_BUSY: { status: 409, message: 'peer has reads in flight: %s' },
  NAT_ERR_MEMORY_IN_USE: { status: 409, message: 'memory in use by a transfer: %s' },
  NAT_ERR_REMOTE_DISCONNECT: { status: 502, message: 'peer disconnected: %s' },
  NAT_ERR_XFER_TIMEOUT: { status: 504, message: 'transfer deadline passed: %s' },
  NAT_ERR_XFER_CANCELED: { status: 499, message: 'transfer canceled: %s' },
  NAT_ERR_XFER_TAINTED: { status: 502, message: 'aborted transfer not yet quiescent: %s' },
  NAT_ERR_NIXL_INVALID_PARAM: { status: 400, message: 'NIXL rejected a parameter: %s' },
  NAT_ERR_NIXL_BACKEND: { status: 502, message: 'NIXL backend error: %s' },
  NAT_ERR_NIXL_INVALID_STATE: { status: 500, message: 'NIXL invalid state: %s' },
  NAT_ERR_NIXL_EXCEPTION: { status: 500, message: 'NIXL raised an exception: %s' },
  NAT_ERR_NIXL_NOT_FOUND: { status: 404, message: 'NIXL found nothing to serve the call: %s' },
  NAT_ERR_NIXL_UNKNOWN_STATUS: { status: 502, message: 'NIXL returned an unknown status: %s' },
  NAT_ERR_SHM: { status: 500, message: 'shared memory failure: %s' },
})

export const {
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
} = nativeErrors

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
  return errorWithDetails(nativeErrors, code, detail, extra) as NativeError
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
