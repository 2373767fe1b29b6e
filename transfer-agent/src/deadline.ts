import type { HeartbeatRecord } from './heartbeats.js'

/**
 * The decoder's side of P's KV lease (DESIGN "Transfer agent" → Deadlines; protocol
 * reference §2.2–2.6). A READ of P's blocks after P reaped them succeeds silently and reads
 * another request's bytes (§2.5), so D decides on its own clock, before posting a READ and
 * again when it completes, whether P's lease is surely still alive. Pure functions, no I/O:
 * every time is a monotonic millisecond on the caller's clock unless a name says seconds.
 *
 * Safety argument (what the property test in test/transfer-agent/deadline.test.ts drives
 * against common/lease-table.ts). Let E0 be P's expiry converted into D's clock, off by at
 * most u (the handshake's half round trip), and let every heartbeat D sent without an error
 * reach P within d. If u + d ≤ margin, then whenever checkLease says ok, P's lease is alive:
 * - the first heartbeat leaves by E0 − margin, so it reaches P before E0 even with both errors;
 * - P then extends to arrival + ext with ext ≥ bound − 2u/3 (the bound is computed from E0,
 *   which may be late by u), and each next heartbeat leaves at most bound − margin after the
 *   previous one, so it too arrives while the lease is alive;
 * - the deadline, max(E0, last + bound) − margin, is therefore no later than P's expiry.
 * A heartbeat lost after a successful send cannot be detected (no acknowledgement, §2.3);
 * that and clock drift during a lease are outside it. So is an offset uncertainty above the
 * margin's cap (lease/4): then the margin is not capped (offset error plus safety) and no
 * heartbeat is credited ('clock_uncertain'), so D reads only while E0 is surely ahead. A
 * handshake takes several samples and keeps the tightest, so that takes a slow link, not one
 * slow round trip.
 */

/** The safety part of the margin when none is configured: vLLM's 5 s (§2.6). */
export const DEFAULT_SAFETY_MS = 5_000

/**
 * vLLM extends to `now + kv_lease_duration*2//3`: integer seconds, floored. For an integer
 * L, ⌊2L/3⌋ ≥ (2L − 2)/3 because 2L mod 3 ≤ 2, so the "− 2" is two whole seconds, 2000 ms
 * here. Taking it as 2 ms would overestimate P's extension by up to 2/3 s (L = 4 s: P extends
 * 2 s, (8000 − 2)/3 ms would claim 2.67 s).
 */
const FLOOR_SLACK_MS = 2_000

/** A handshake's clock reading: producer time minus local time, and how sure we are. */
export interface ClockSample {
  /** Producer clock minus local monotonic clock, ms. */
  readonly offsetMs: number
  /** Half the round trip, ms: the reading was taken somewhere inside it. */
  readonly uncertaintyMs: number
  readonly rttMs: number
}

/**
 * The offset from one handshake: the request left at `sentAt`, the reply (carrying P's clock
 * reading `producerSeconds`, e.g. its `perf_counter`) came back at `receivedAt`. The reading
 * is placed at the midpoint, as vLLM does (§2.6), so the error is at most half the round trip.
 */
export function clockSample(sentAt: number, producerSeconds: number, receivedAt: number): ClockSample {
  const rttMs = receivedAt - sentAt
  if (!Number.isFinite(rttMs) || rttMs < 0) throw new RangeError(`clock sample: reply before request (${sentAt} → ${receivedAt})`)
  if (!Number.isFinite(producerSeconds)) throw new RangeError(`clock sample: producer reading ${producerSeconds} is not finite`)
  return { offsetMs: producerSeconds * 1000 - (sentAt + receivedAt) / 2, uncertaintyMs: rttMs / 2, rttMs }
}

/** Keeps the lowest-RTT sample (vLLM keeps the best of its handshakes the same way). */
export function betterSample(current: ClockSample | undefined, next: ClockSample): ClockSample {
  return current && current.rttMs <= next.rttMs ? current : next
}

/** P's expiry on D's clock: E0, and the offset uncertainty that comes with it. */
export interface LocalExpiry {
  /** E0, local monotonic ms. */
  readonly e0: number
  readonly uncertaintyMs: number
}

/** Converts `remote_blocks_expiry_time` (producer clock, seconds) into D's clock. */
export function toLocalExpiry(producerExpirySeconds: number, sample: ClockSample): LocalExpiry {
  if (!Number.isFinite(producerExpirySeconds)) throw new RangeError(`expiry ${producerExpirySeconds} is not finite`)
  return { e0: producerExpirySeconds * 1000 - sample.offsetMs, uncertaintyMs: sample.uncertaintyMs }
}

/**
 * A lower bound on how far one heartbeat extends P's lease, ms, without knowing P's config:
 * `(2 × (E0 − first) − 2 s) / 3`. P's lease L started when P finished, before D could send
 * anything, so L ≥ E0 − first; P extends to arrival + ⌊2L/3⌋ s (§2.3), and
 * ⌊2L/3⌋ ≥ (2L − 2 s)/3. Heartbeats go out every L/6, well inside the bound.
 */
export function extensionBoundMs(e0: number, firstSentAt: number): number {
  return (2 * (e0 - firstSentAt) - FLOOR_SLACK_MS) / 3
}

/**
 * The margin, ms: offset uncertainty plus safety, never more than a quarter of the lease, so
 * a short lease (tests use 5 s) still leaves reads that can succeed.
 */
export function marginMs(uncertaintyMs: number, leaseMs: number, safetyMs = DEFAULT_SAFETY_MS): number {
  return Math.max(0, Math.min(uncertaintyMs + safetyMs, leaseMs / 4))
}

export type LeaseDeclineReason = 'expired' | 'heartbeat_gap' | 'heartbeat_failed' | 'late_first_heartbeat' | 'no_heartbeat' | 'clock_uncertain'

/** Why the heartbeats do not count, or 'unbroken' when they do. */
export type HeartbeatChain = 'unbroken' | Exclude<LeaseDeclineReason, 'expired'>

export interface LeaseInput {
  expiry: LocalExpiry
  /** The pull's heartbeats; undefined when none are tracked (nothing extends the lease). */
  heartbeats: HeartbeatRecord | undefined
  /**
   * The lease for the margin's cap, ms: D's configured `kv_lease_duration` (which must equal
   * P's, §2.4). Default: what D can infer, E0 − the time it accepted the pull (the record's
   * startedAt). That never exceeds the true lease and, unlike E0 − first heartbeat, is fixed
   * from the start, so a late first heartbeat cannot shrink the margin. With neither, the
   * margin is not capped.
   */
  leaseMs?: number
  safetyMs?: number
}

export interface LeaseDeadline {
  /** Past this local monotonic ms, D must not read. */
  readonly deadline: number
  readonly marginMs: number
  /** extensionBoundMs, once a heartbeat was sent. */
  readonly boundMs: number | undefined
  readonly chain: HeartbeatChain
}

/** The deadline for reading P's blocks, from E0 and the heartbeats sent so far. */
export function leaseDeadline(input: LeaseInput): LeaseDeadline {
  const { e0, uncertaintyMs } = input.expiry
  const hb = input.heartbeats
  const leaseMs = input.leaseMs ?? (hb ? e0 - hb.startedAt : Number.POSITIVE_INFINITY)
  if (uncertaintyMs > leaseMs / 4) {
    // Past the cap the proof above does not hold: no credit, and the whole offset error.
    const margin = uncertaintyMs + (input.safetyMs ?? DEFAULT_SAFETY_MS)
    return { deadline: e0 - margin, marginMs: margin, boundMs: undefined, chain: 'clock_uncertain' }
  }
  const margin = marginMs(uncertaintyMs, leaseMs, input.safetyMs)
  if (!hb || hb.firstSentAt === undefined || hb.lastSentAt === undefined) {
    return { deadline: e0 - margin, marginMs: margin, boundMs: undefined, chain: 'no_heartbeat' }
  }
  const bound = extensionBoundMs(e0, hb.firstSentAt)
  let chain: HeartbeatChain = 'unbroken'
  if (hb.failed) chain = 'heartbeat_failed'
  // The first one must reach P before E0 even if it is late by the margin.
  else if (hb.firstSentAt > e0 - margin) chain = 'late_first_heartbeat'
  // A heartbeat extends from when it arrives, and each link needs the margin for delivery
  // delay and for the offset error in the bound, not only the last one: a gap of a full
  // bound plus a slow delivery can reach P after the previous extension ran out.
  else if (hb.maxGapMs > bound - margin) chain = 'heartbeat_gap'
  const deadline = chain === 'unbroken' ? Math.max(e0, hb.lastSentAt + bound) - margin : e0 - margin
  return { deadline, marginMs: margin, boundMs: bound, chain }
}

export type LeaseCheck =
  | { readonly ok: true; readonly deadline: number }
  | { readonly ok: false; readonly reason: LeaseDeclineReason; readonly deadline: number }

/**
 * Whether D may read P's blocks at `now`: before posting a READ, and again when it completes
 * (a lease that ran out while the READ was in flight makes the pull KV-expired). A decline
 * names the broken heartbeat chain when heartbeats would have had to carry the lease this
 * far, and 'expired' when the chain held but its deadline passed too.
 */
export function checkLease(now: number, input: LeaseInput): LeaseCheck {
  const { deadline, chain } = leaseDeadline(input)
  if (now < deadline) return { ok: true, deadline }
  return { ok: false, reason: chain === 'unbroken' ? 'expired' : chain, deadline }
}
