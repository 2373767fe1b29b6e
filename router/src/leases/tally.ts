import type { LeaseRecord, LeaseSummary } from './ledger.js'

/** The summary's unread part: what one set of lease records adds up to. */
export type UnreadTally = Pick<LeaseSummary, 'inFlight' | 'byPrefill' | 'byDecode' | 'oldestAgeMs'> & { leases: LeaseRecord[] }

/** GET /leases lists at most this many unread leases of an instance. */
export const UNREAD_LISTED = 100

/**
 * Unread at `now`: being read (D's heartbeats hold it) and followed by its exchange, or
 * issued or abandoned and not past expiry.
 */
export function isUnread(rec: LeaseRecord, now: number): boolean {
  if (rec.state === 'reading' && rec.abandonedAt === undefined) return true
  return (rec.state === 'issued' || rec.state === 'reading') && rec.expiresAt > now
}

/**
 * Counts `records` (all unread) into a tally; with an instance filter only those with it as
 * prefiller or decoder, and those are listed (copies, oldest first, at most UNREAD_LISTED).
 */
export function tallyUnread(records: Iterable<LeaseRecord>, now: number, filter: { instance?: string } = {}): UnreadTally {
  const tally: UnreadTally = { inFlight: { issued: 0, reading: 0 }, byPrefill: {}, byDecode: {}, oldestAgeMs: null, leases: [] }
  for (const rec of records) {
    if (filter.instance !== undefined && rec.prefill !== filter.instance && rec.decode !== filter.instance) continue
    if (rec.state === 'issued') tally.inFlight.issued++
    else tally.inFlight.reading++
    tally.byPrefill[rec.prefill] = (tally.byPrefill[rec.prefill] ?? 0) + 1
    tally.byDecode[rec.decode] = (tally.byDecode[rec.decode] ?? 0) + 1
    const age = now - rec.issuedAt
    tally.oldestAgeMs = tally.oldestAgeMs === null ? age : Math.max(tally.oldestAgeMs, age)
    if (filter.instance !== undefined) tally.leases.push({ ...rec })
  }
  tally.leases = oldestFirst(tally.leases)
  return tally
}

/** `summary` with `more` (other routers' unread leases) added to its unread part. */
export function addTally(summary: LeaseSummary, more: UnreadTally): LeaseSummary {
  const out: LeaseSummary = {
    ...summary,
    inFlight: { issued: summary.inFlight.issued + more.inFlight.issued, reading: summary.inFlight.reading + more.inFlight.reading },
    byPrefill: addCounts(summary.byPrefill, more.byPrefill),
    byDecode: addCounts(summary.byDecode, more.byDecode),
    oldestAgeMs: summary.oldestAgeMs === null || more.oldestAgeMs === null ? (summary.oldestAgeMs ?? more.oldestAgeMs) : Math.max(summary.oldestAgeMs, more.oldestAgeMs),
  }
  if (summary.leases) out.leases = oldestFirst([...summary.leases, ...more.leases])
  return out
}

function oldestFirst(leases: LeaseRecord[]): LeaseRecord[] {
  return leases.sort((a, b) => a.issuedAt - b.issuedAt).slice(0, UNREAD_LISTED)
}

function addCounts(a: Record<string, number>, b: Record<string, number>): Record<string, number> {
  const out = { ...a }
  for (const [k, n] of Object.entries(b)) out[k] = (out[k] ?? 0) + n
  return out
}
