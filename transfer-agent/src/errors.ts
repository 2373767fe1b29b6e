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
})

export const {
  XFA_ERR_INVALID_ARG,
  XFA_ERR_PEER_GONE,
  XFA_ERR_PEER_DISCONNECTED,
  XFA_ERR_HANDSHAKE_FAILED,
  XFA_ERR_ENGINE_ID_MISMATCH,
  XFA_ERR_KV_EXPIRED,
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
