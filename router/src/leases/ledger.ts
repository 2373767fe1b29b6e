/**
 * The seam for the lease ledger (a later issue fills it): every handoff the router hands
 * out is reported here with its lifecycle. Until then the router runs with
 * `untrackedLedger`, which records nothing; the call sites are already where they belong.
 */
export interface HandoffLease {
  /** The handoff's engine request id (fresh per handoff, sent to P and D). */
  requestId: string
  /** The client's X-Request-Id, for logs. */
  clientRequestId: string
  prefill: string
  decode: string
  engineId: string
  /** P's internal request id; absent on vLLM releases before late 2025. */
  remoteRequestId?: string
  /** Wall-clock ms when P's answer arrived. */
  issuedAt: number
}

export type LeaseEndReason = 'client_gone' | 'decode_failed' | 'router_error'

export interface LeaseLedger {
  /** P answered with kv_transfer_params: the blocks are pinned for this request. */
  issue(lease: HandoffLease): void
  /** The first decoder refused the connection; the params go to `decode` instead. */
  redirect(requestId: string, decode: string): void
  /** D accepted the request and is (about to be) reading. */
  reading(requestId: string): void
  /** D produced its first byte: the read is done. */
  done(requestId: string): void
  /** The handoff ended without a read; P's blocks should be released. */
  release(requestId: string, reason: LeaseEndReason): void
}

export const untrackedLedger: LeaseLedger = Object.freeze({
  issue: () => {},
  redirect: () => {},
  reading: () => {},
  done: () => {},
  release: () => {},
})
