/**
 * The seam for the lease ledger (a later issue fills it): every handoff the router hands
 * out is reported here with its lifecycle. Until then the router runs with
 * `untrackedLedger`, which records nothing; the call sites are already where they belong.
 */
export interface HandoffLease {
  requestId: string
  prefill: string
  decode: string
  engineId: string
  remoteRequestId: string
  /** Wall-clock ms when P's answer arrived. */
  issuedAt: number
}

export type LeaseEndReason = 'client_gone' | 'decode_failed' | 'router_error'

export interface LeaseLedger {
  /** P answered with kv_transfer_params: the blocks are pinned for this request. */
  issue(lease: HandoffLease): void
  /** D accepted the request and is (about to be) reading. */
  reading(requestId: string): void
  /** D produced its first byte: the read is done. */
  done(requestId: string): void
  /** The handoff ended without a read; P's blocks should be released. */
  release(requestId: string, reason: LeaseEndReason): void
}

export const untrackedLedger: LeaseLedger = Object.freeze({
  issue: () => {},
  reading: () => {},
  done: () => {},
  release: () => {},
})
