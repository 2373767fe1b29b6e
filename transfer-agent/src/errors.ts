import type createError from '@fastify/error'
import { codedErrorsWith, errorWithDetails, isTableError } from '../../common/coded-error.js'

/**
 * Coded errors of the transfer agent (`XFA_ERR_*`), built by the factory every package
 * shares (common/coded-error.ts). Callers branch on `err.code`; the message is for people.
 * Errors about one peer also carry its `engineId` (and `address` where known) and chain the
 * underlying failure as `cause`. The table is mirrored in docs/errors.md, section
 * "transfer-agent (XFA_ERR_*)".
 */
export interface XfaErrorDetails {
  engineId?: string
  address?: string
}

type Args = [detail: string, options?: { cause?: unknown }]

// 410 for "this peer or lease no longer exists, do not retry it", 502 for a peer that
// answered wrongly or not at all, 400 for caller mistakes.
export const xfaErrors = codedErrorsWith<Args>()({
  XFA_ERR_INVALID_ARG: { status: 400, message: 'invalid argument: %s' },
  XFA_ERR_PEER_GONE: { status: 410, message: 'peer gone: %s' },
  XFA_ERR_PEER_DISCONNECTED: { status: 502, message: 'peer disconnected: %s' },
  XFA_ERR_HANDSHAKE_FAILED: { status: 502, message: 'handshake failed: %s' },
  XFA_ERR_ENGINE_ID_MISMATCH: { status: 502, message: 'handshake answered with another engine_id: %s' },
  XFA_ERR_KV_EXPIRED: { status: 410, message: 'KV lease expired: %s' },
  XFA_ERR_NO_LEASE_EXPIRY: { status: 400, message: 'the pull names no lease expiry (remoteBlocksExpiryTime null): %s' },
  XFA_ERR_READ_FAILED: { status: 502, message: 'KV read failed: %s' },
  XFA_ERR_PULL_CANCELED: { status: 409, message: 'pull canceled: %s' },
  XFA_ERR_PULL_EXISTS: { status: 409, message: 'a pull for this request is in flight: %s' },
  XFA_ERR_TOO_MANY_PULLS: { status: 429, message: 'too many expected pulls: %s' },
  XFA_ERR_LEASE_EXISTS: { status: 409, message: 'lease exists: %s' },
  XFA_ERR_BLOCKS_LEASED: { status: 409, message: 'blocks already leased: %s' },
  XFA_ERR_NOT_ATTACHED: { status: 409, message: 'no engine attached: %s' },
  XFA_ERR_ATTACH_FAILED: { status: 500, message: 'attach failed: %s' },
  XFA_ERR_ATTACH_REFUSED: { status: 403, message: 'attach refused: %s' },
  XFA_ERR_REGION_IN_USE: { status: 409, message: 'the KV region is attached by another agent: %s' },
  XFA_ERR_UNAUTHORIZED: { status: 401, message: 'unauthorized: %s' },
  XFA_ERR_NOT_FOUND: { status: 404, message: 'not found: %s' },
  XFA_ERR_NIXL_UNAVAILABLE: { status: 503, message: 'NIXL not available: %s' },
  XFA_ERR_SHUTTING_DOWN: { status: 503, message: 'shutting down: %s' },
})

export const {
  XFA_ERR_INVALID_ARG,
  XFA_ERR_PEER_GONE,
  XFA_ERR_PEER_DISCONNECTED,
  XFA_ERR_HANDSHAKE_FAILED,
  XFA_ERR_ENGINE_ID_MISMATCH,
  XFA_ERR_KV_EXPIRED,
  XFA_ERR_NO_LEASE_EXPIRY,
  XFA_ERR_READ_FAILED,
  XFA_ERR_PULL_CANCELED,
  XFA_ERR_PULL_EXISTS,
  XFA_ERR_TOO_MANY_PULLS,
  XFA_ERR_LEASE_EXISTS,
  XFA_ERR_BLOCKS_LEASED,
  XFA_ERR_NOT_ATTACHED,
  XFA_ERR_ATTACH_FAILED,
  XFA_ERR_ATTACH_REFUSED,
  XFA_ERR_REGION_IN_USE,
  XFA_ERR_UNAUTHORIZED,
  XFA_ERR_NOT_FOUND,
  XFA_ERR_NIXL_UNAVAILABLE,
  XFA_ERR_SHUTTING_DOWN,
} = xfaErrors

export type XfaErrorCode = keyof typeof xfaErrors

export type XfaError = createError.FastifyError & XfaErrorDetails & { code: XfaErrorCode }

/** Builds a coded error with the peer details attached when there are any. */
export function xfaError(code: XfaErrorCode, detail: string, extra: XfaErrorDetails & { cause?: unknown } = {}): XfaError {
  return errorWithDetails(xfaErrors, code, detail, extra) as XfaError
}

/** Whether `err` was built by this table (by its code and class, not a look-alike). */
export function isXfaError(err: unknown): err is XfaError {
  return isTableError(xfaErrors, err)
}
