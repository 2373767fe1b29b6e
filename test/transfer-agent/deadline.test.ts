import t from 'tap'
import { ManualClock } from '../../common/clock.js'
import { LeaseTable, type LeaseEndReason } from '../../common/lease-table.js'
import { seededRandom } from '../../common/random.js'
import {
  betterSample,
  checkLease,
  clockSample,
  DEFAULT_SAFETY_MS,
  extensionBoundMs,
  leaseDeadline,
  marginMs,
  toLocalExpiry,
  type LeaseInput,
  type LocalExpiry,
} from '../../transfer-agent/src/deadline.js'
import { HeartbeatRegistry } from '../../transfer-agent/src/heartbeats.js'

// Most cases: P finished at 0 with a 30 s lease (E0 = 30 s, exact clock), D accepted the
// pull at 0.5 s. Margin = min(0 + 5 s, (30 − 0.5) s / 4) = 5 s; bound = (2 × 29.5 − 2) / 3 s =
// 19 s, so a heartbeat may follow the previous one by up to 19 − 5 = 14 s.
const E0: LocalExpiry = { e0: 30_000, uncertaintyMs: 0 }

interface Pull {
  clock: ManualClock
  hb: HeartbeatRegistry
  /** The prefiller on the same clock, reaping eagerly; heartbeats that were sent arrive at once. */
  table: LeaseTable<null>
  ended: LeaseEndReason[]
  input: () => LeaseInput
  sendAt: (ms: number, ok?: boolean) => void
}

function pull(): Pull {
  const clock = new ManualClock({ monotonic: 0 })
  const ended: LeaseEndReason[] = []
  const table = new LeaseTable<null>({ clock, leaseMs: 30_000, onEnd: (_l, r) => ended.push(r) })
  table.pin('r1', null)
  const hb = new HeartbeatRegistry({ clock })
  clock.advance(500)
  hb.start('p0', 'r1')
  return {
    clock,
    hb,
    table,
    ended,
    input: () => ({ expiry: E0, heartbeats: hb.get('p0', 'r1') }),
    sendAt(ms, ok = true) {
      clock.advance(ms - clock.monotonic())
      hb.sent('p0', 'r1', ok)
      table.reap()
      if (ok) table.heartbeat('r1')
    },
  }
}

/** Moves to `ms`, lets P reap, and returns whether P still holds the lease. */
function aliveAt(p: Pull, ms: number): boolean {
  p.clock.advance(ms - p.clock.monotonic())
  p.table.reap()
  return p.table.get('r1') !== undefined
}

t.test('a read after the original expiry that heartbeats kept alive proceeds', async (t) => {
  const p = pull()
  const { hb, input, sendAt } = p
  t.equal(checkLease(26_000, input()).ok, false, 'without heartbeats 26 s is past E0 − margin')
  for (let at = 500; at <= 35_500; at += 5_000) sendAt(at)
  t.equal(hb.get('p0', 'r1')?.maxGapMs, 5_000)
  t.match(leaseDeadline(input()), { marginMs: 5_000, boundMs: 19_000, chain: 'unbroken', deadline: 35_500 + 19_000 - 5_000 })
  t.same(checkLease(36_000, input()), { ok: true, deadline: 49_500 }, 'READ posted 6 s after E0')
  t.ok(aliveAt(p, 36_000))
  t.same(checkLease(40_000, input()), { ok: true, deadline: 49_500 }, 'and completed')
  t.ok(aliveAt(p, 49_499), 'P extended to 35.5 + 20 = 55.5 s')
  t.same(checkLease(49_500, input()), { ok: false, reason: 'expired', deadline: 49_500 })
})

t.test('a failed heartbeat send breaks the chain', async (t) => {
  const { input, sendAt } = pull()
  sendAt(500)
  sendAt(5_500)
  sendAt(10_500, false)
  for (let at = 15_500; at <= 35_500; at += 5_000) sendAt(at)
  t.same(checkLease(20_000, input()), { ok: true, deadline: 25_000 }, 'within the original lease a read is fine')
  t.same(checkLease(26_000, input()), { ok: false, reason: 'heartbeat_failed', deadline: 25_000 })
})

t.test('a heartbeat gap longer than the extension is declined, and P really did reap', async (t) => {
  const p = pull()
  for (let at = 500; at <= 15_500; at += 5_000) p.sendAt(at)
  p.sendAt(36_000) // 20.5 s after the last: P's +20 s ran out at 35.5 s
  t.same(p.ended, ['expired'], 'P reaped at 35.5 s')
  t.same(checkLease(36_500, p.input()), { ok: false, reason: 'heartbeat_gap', deadline: 25_000 })
})

t.test('no heartbeats: reads only before E0 − margin', async (t) => {
  const p = pull()
  const { input } = p
  t.same(checkLease(24_999, input()), { ok: true, deadline: 25_000 })
  t.same(checkLease(25_000, input()), { ok: false, reason: 'no_heartbeat', deadline: 25_000 })
  // No record at all: nothing caps the margin, nothing extends the lease.
  t.same(checkLease(25_000, { expiry: E0, heartbeats: undefined }), { ok: false, reason: 'no_heartbeat', deadline: 25_000 })
  t.match(leaseDeadline({ expiry: { e0: 30_000, uncertaintyMs: 40 }, heartbeats: undefined }), { marginMs: 5_040, boundMs: undefined })
  t.notOk(aliveAt(p, 30_000), 'P reaps at E0')
})

t.test('a late first heartbeat is declined', async (t) => {
  const p = pull()
  // Sent after E0 − margin: with the offset error and delivery delay the margin allows for,
  // it may have reached P after the original lease ran out.
  for (let at = 26_000; at <= 36_000; at += 5_000) p.sendAt(at)
  t.same(checkLease(27_000, p.input()), { ok: false, reason: 'late_first_heartbeat', deadline: 25_000 })
})

t.test('a lease that expires while the READ is in flight fails the completion check', async (t) => {
  const { input, sendAt } = pull()
  for (let at = 500; at <= 20_500; at += 5_000) sendAt(at)
  // Then the engine stalls (heartbeats come from its forward loop) while the READ runs.
  const posted = checkLease(30_000, input())
  t.same(posted, { ok: true, deadline: 20_500 + 19_000 - 5_000 })
  t.same(checkLease(35_000, input()), { ok: false, reason: 'expired', deadline: 34_500 })
  const p = pull()
  for (let at = 500; at <= 20_500; at += 5_000) p.sendAt(at)
  t.notOk(aliveAt(p, 41_000), 'P reaped at 20.5 + 20 = 40.5 s')
  t.same(checkLease(41_000, p.input()), { ok: false, reason: 'expired', deadline: 34_500 }, 'a slow READ completing then is KV-expired')

  const quiet = pull()
  t.equal(checkLease(24_000, quiet.input()).ok, true, 'posted inside the original lease')
  t.same(checkLease(25_500, quiet.input()), { ok: false, reason: 'no_heartbeat', deadline: 25_000 })
})

t.test('the extension bound is in ms, with vLLM’s floor taken as 2 whole seconds', async (t) => {
  t.equal(extensionBoundMs(30_000, 0), 58_000 / 3)
  t.equal(extensionBoundMs(4_000, 0), 2_000, '4 s lease: P extends ⌊8/3⌋ = 2 s')
  t.equal(extensionBoundMs(1_000, 0), 0, '1 s lease: P extends ⌊2/3⌋ = 0 s')
  // Against vLLM's integer rule for every whole-second lease, read at the earliest possible
  // first heartbeat (when P finished): a lower bound, and never more than 2/3 s below.
  for (let l = 1; l <= 600; l++) {
    const vllm = Math.floor((l * 2) / 3) * 1000
    const bound = extensionBoundMs(l * 1000, 0)
    if (bound > vllm + 1e-9 || vllm - bound > 2000 / 3 + 1e-9) t.fail(`lease ${l} s: bound ${bound} ms vs P's ${vllm} ms`)
  }
  // A later first heartbeat only lowers the bound: L ≥ E0 − first.
  t.ok(extensionBoundMs(30_000, 5_000) < extensionBoundMs(30_000, 0))
})

t.test('the margin is never more than a quarter of the lease', async (t) => {
  t.equal(marginMs(0, 30_000), DEFAULT_SAFETY_MS)
  t.equal(marginMs(300, 30_000), 5_300)
  t.equal(marginMs(300, 5_000), 1_250, '5 s test lease')
  t.equal(marginMs(0, 30_000, 1_000), 1_000)
  t.equal(marginMs(0, -5), 0)
  const rnd = seededRandom(7)
  for (let i = 0; i < 1_000; i++) {
    const lease = rnd.next() * 60_000
    const m = marginMs(rnd.next() * 10_000, lease, rnd.next() * 10_000)
    if (m > lease / 4) t.fail(`margin ${m} > lease ${lease} / 4`)
  }
  // So a 5 s lease read promptly succeeds (an uncapped 5 s margin would fail every read).
  const clock = new ManualClock()
  const hb = new HeartbeatRegistry({ clock })
  hb.start('p0', 'r')
  t.same(checkLease(1_000, { expiry: { e0: 5_000, uncertaintyMs: 10 }, heartbeats: hb.get('p0', 'r') }), { ok: true, deadline: 3_750 })
  // A configured lease (D's kv_lease_duration) caps it instead of the inferred one.
  t.equal(leaseDeadline({ expiry: { e0: 5_000, uncertaintyMs: 0 }, heartbeats: hb.get('p0', 'r'), leaseMs: 8_000 }).marginMs, 2_000)
})

t.test('an offset uncertainty above a quarter lease: no heartbeat credit, the whole error in the margin (issue 17 item 5)', async (t) => {
  // 5 s lease, D accepted at 0, heartbeats every 800 ms: credit would carry it past E0.
  const clock = new ManualClock()
  const hb = new HeartbeatRegistry({ clock })
  hb.start('p0', 'r')
  for (let at = 0; at <= 4_000; at += 800) {
    clock.advance(at - clock.monotonic())
    hb.sent('p0', 'r', true)
  }
  const tight: LeaseInput = { expiry: { e0: 5_000, uncertaintyMs: 10 }, heartbeats: hb.get('p0', 'r'), leaseMs: 5_000, safetyMs: 500 }
  t.match(leaseDeadline(tight), { chain: 'unbroken' }, 'a tight reading: heartbeats count')
  // A 2.6 s round trip (1.3 s uncertainty > 1.25 s): the margin cannot cover the offset error.
  const loose: LeaseInput = { ...tight, expiry: { e0: 5_000, uncertaintyMs: 1_300 } }
  t.same(leaseDeadline(loose), { deadline: 5_000 - 1_300 - 500, marginMs: 1_800, boundMs: undefined, chain: 'clock_uncertain' })
  t.same(checkLease(3_200, loose), { ok: false, reason: 'clock_uncertain', deadline: 3_200 })
  t.equal(checkLease(3_199, loose).ok, true, 'inside E0 less the whole error it still reads')
  // Exactly at the cap the proof holds.
  t.match(leaseDeadline({ ...tight, expiry: { e0: 5_000, uncertaintyMs: 1_250 } }), { chain: 'unbroken' })
})

t.test('E0 from the producer clock via the handshake reading', async (t) => {
  const epoch = 123_456_789 // P's clock (ms) minus ours
  const producerSeconds = (local: number): number => (local + epoch) / 1000
  // Out 30 ms, back 10 ms: the midpoint is 10 ms off, inside the 20 ms half round trip.
  const sample = clockSample(1_000, producerSeconds(1_030), 1_040)
  t.equal(sample.rttMs, 40)
  t.equal(sample.uncertaintyMs, 20)
  const expiry = toLocalExpiry(producerSeconds(31_030), sample)
  t.ok(Math.abs(expiry.e0 - 31_030) <= expiry.uncertaintyMs, `E0 ${expiry.e0} within 20 ms of 31030`)
  t.equal(Math.round(expiry.e0), 31_020)
  t.equal(expiry.uncertaintyMs, 20)
  // The lowest round trip wins; the uncertainty feeds the margin.
  const tight = clockSample(5_000, producerSeconds(5_001), 5_002)
  t.equal(betterSample(undefined, sample), sample)
  t.equal(betterSample(sample, tight), tight)
  t.equal(betterSample(tight, sample), tight)
  t.equal(marginMs(sample.uncertaintyMs, 30_000), 5_020)
  t.throws(() => clockSample(10, 1, 5), RangeError)
  t.throws(() => clockSample(0, Number.NaN, 5), RangeError)
  t.throws(() => toLocalExpiry(Number.POSITIVE_INFINITY, tight), RangeError)
})

t.test('why a gap may only be bound − margin: a full-bound gap plus a slow delivery reads a reaped lease', async (t) => {
  // 4 s lease pinned at 0, D accepted at once, exact clock: bound 2 s, margin 1 s.
  const clock = new ManualClock()
  const ended: LeaseEndReason[] = []
  const table = new LeaseTable<null>({ clock, leaseMs: 4_000, onEnd: (_l, r) => ended.push(r) })
  const hb = new HeartbeatRegistry({ clock })
  table.pin('r', null)
  hb.start('p0', 'r')
  const input = (): LeaseInput => ({ expiry: { e0: 4_000, uncertaintyMs: 0 }, heartbeats: hb.get('p0', 'r') })
  for (const at of [0, 1_000, 2_000]) {
    clock.advance(at - clock.monotonic())
    hb.sent('p0', 'r', true)
    table.heartbeat('r')
  }
  t.match(leaseDeadline(input()), { boundMs: 2_000, marginMs: 1_000 })
  // Next one 2 s later (= the bound), delivered 700 ms late (< the margin): P's extension
  // from 2 s ran out at 4.667 s, before it arrived.
  clock.advance(2_000)
  hb.sent('p0', 'r', true)
  clock.advance(700)
  table.reap()
  t.notOk(table.heartbeat('r'), 'arrived after P reaped')
  t.same(ended, ['expired'])
  // A "gap ≤ bound" rule would have allowed reading until 4 + 2 − 1 = 5 s.
  clock.advance(100)
  t.same(checkLease(4_800, input()), { ok: false, reason: 'heartbeat_gap', deadline: 3_000 })
})

/**
 * The property: on one ManualClock, a prefiller (common/lease-table.ts, reaping eagerly: the
 * worst case for D) and the decoder logic run a seeded schedule; whenever checkLease says ok,
 * P's lease is alive at that instant. The schedule draws the handshake's out/back delays, P's
 * clock epoch, when P finishes and D accepts, heartbeat jitter, engine stalls (gaps up to a
 * lease), late first heartbeats, failed sends (which never reach P), delivery delays within
 * the stated assumption (offset error + delay ≤ margin), the READ's start and duration, and
 * 20 random probes while the pull is live.
 */
interface Tally {
  releasedBeforeDispatch: number
  releasedUnderPull: number
  checks: number
  oks: number
  oksPastE0: number
  reads: number
  readsOk: number
  reapedUnderPull: number
  violations: string[]
}

type Check = (now: number, input: LeaseInput) => boolean
const realCheck: Check = (now, input) => checkLease(now, input).ok

/**
 * What else acts on P's lease besides expiry (issue 17 item 1):
 * - `router`: `undispatched` releases some leases before D was sent the params (the rule the
 *   ledger keeps: D then never pulls); `any` also releases leases D is reading (the broken
 *   rule: a router acting on its own inference, D marked down or its leg failed).
 * - `slowP`: P applies the notifications that reached it only after a processing delay (a
 *   busy event loop, up to 1.5 leases) while its reaper keeps its schedule; `drain_first` applies the ones that
 *   arrived before each reap (common/lease-table.ts `defer`), `reap_first` reaps first.
 */
interface Model {
  router?: 'undispatched' | 'any'
  slowP?: 'drain_first' | 'reap_first'
}

function runSchedule(seed: number, leaseMs: number, check: Check, out: Tally, model: Model = {}): void {
  const rnd = seededRandom(seed)
  const r = (lo: number, hi: number): number => lo + (hi - lo) * rnd.next()
  const clock = new ManualClock({ monotonic: r(0, 1e6) })
  const pEpochMs = r(-1e8, 1e8)
  const producerSeconds = (): number => (clock.monotonic() + pEpochMs) / 1000
  let live = false
  const table = new LeaseTable<null>({
    clock,
    leaseMs,
    onEnd: (_l, reason) => {
      if (live && reason === 'expired') out.reapedUnderPull++
    },
  })
  const registry = new HeartbeatRegistry({ clock })
  const id = `r${seed}`
  // Notifications that reached P, not yet applied (slowP): arrival time, in order.
  const queued: number[] = []
  const apply = (): void => {
    queued.shift()
    table.heartbeat(id)
  }
  /** P's reaper, with the slow-P rule in force. */
  const reap = (): void => {
    if (model.slowP === 'drain_first') while (queued.length > 0 && (queued[0] as number) <= clock.monotonic()) apply()
    table.reap()
  }

  // Handshake: P reads its clock `out` after the request left, the reply takes `back`.
  const sentAt = clock.monotonic()
  clock.advance(r(0, leaseMs / 40))
  const reading = producerSeconds()
  clock.advance(r(0, leaseMs / 40))
  const sample = clockSample(sentAt, reading, clock.monotonic())

  clock.advance(r(0, leaseMs))
  const lease = table.pin(id, null)
  const e0True = lease.deadline
  const expiry = toLocalExpiry((lease.deadline + pEpochMs) / 1000, sample)
  if (model.router && rnd.next() < 0.3) {
    // The client left, or the lease lapsed, before the decode leg: released, never dispatched.
    table.release(id)
    out.releasedBeforeDispatch++
    clock.advance(6 * leaseMs)
    return
  }
  clock.advance(r(0, leaseMs / 3)) // the router hop to D
  registry.start('p0', id)
  live = true
  const input = (): LeaseInput => ({ expiry, heartbeats: registry.get('p0', id) })
  // Delivery delay: anything the margin covers after the offset error (the assumption).
  const maxDelay = leaseDeadline(input()).marginMs - sample.uncertaintyMs
  // Half the deliveries near the limit: the adversarial end of what is allowed.
  const delay = (): number => (rnd.next() < 0.5 ? r(0.8, 1) : r(0, 1)) * maxDelay
  const failRate = [0, 0, 0.05, 0.3][Math.floor(rnd.next() * 4)] as number
  const stallRate = [0, 0.05, 0.2][Math.floor(rnd.next() * 3)] as number

  const probe = (what: string): boolean => {
    if (!live) return false
    reap()
    const now = clock.monotonic()
    out.checks++
    if (!check(now, input())) return false
    out.oks++
    if (now >= e0True) out.oksPastE0++
    if (!table.get(id)) out.violations.push(`seed ${seed}, ${leaseMs} ms lease: ${what} ok at +${(now - e0True).toFixed(1)} ms past E0 after P reaped`)
    return true
  }
  const end = (): void => {
    live = false
    registry.end('p0', id)
  }

  const interval = leaseMs / 6
  const heartbeat = (): void => {
    if (!live) return
    const ok = rnd.next() >= failRate
    registry.sent('p0', id, ok)
    if (ok) {
      clock.setTimeout(() => {
        if (!model.slowP) {
          reap()
          table.heartbeat(id)
          return
        }
        // Reached P; applied when P's loop gets to it, up to a lease and a half later.
        queued.push(clock.monotonic())
        clock.setTimeout(() => {
          if (queued.length > 0) apply()
        }, r(0, 1.5 * leaseMs))
      }, delay())
    }
    probe('heartbeat')
    clock.setTimeout(heartbeat, interval * r(0.8, 1.2) + (rnd.next() < stallRate ? r(0, leaseMs) : 0))
  }
  clock.setTimeout(heartbeat, rnd.next() < 0.15 ? r(0, leaseMs) : r(0, interval / 4))

  clock.setTimeout(() => {
    out.reads++
    if (!probe('READ post')) return end()
    clock.setTimeout(() => {
      if (probe('READ completion')) {
        out.readsOk++
        clock.setTimeout(() => table.readDone(id), delay())
      }
      end()
    }, r(0, leaseMs / 2))
  }, r(0, 2 * leaseMs))
  for (let i = 0; i < 20; i++) clock.setTimeout(() => probe('probe'), r(0, 2.5 * leaseMs))
  if (model.slowP) {
    // P's own reaper, on its schedule whatever else is queued.
    const tick = (): void => {
      reap()
      clock.setTimeout(tick, leaseMs / 10)
    }
    clock.setTimeout(tick, leaseMs / 10)
  }
  if (model.router === 'any') {
    // The broken rule: the router ends the lease while D may be reading.
    clock.setTimeout(() => {
      if (!live || !table.get(id)) return
      table.release(id)
      out.releasedUnderPull++
    }, r(0, 2 * leaseMs))
  }
  clock.advance(6 * leaseMs)
}

const SCHEDULES = 2_000

function tally(leaseMs: number, check: Check, model: Model = {}): Tally {
  const out: Tally = { releasedBeforeDispatch: 0, releasedUnderPull: 0, checks: 0, oks: 0, oksPastE0: 0, reads: 0, readsOk: 0, reapedUnderPull: 0, violations: [] }
  for (let seed = 1; seed <= SCHEDULES; seed++) runSchedule(seed * 7919 + leaseMs, leaseMs, check, out, model)
  return out
}

for (const leaseMs of [1_000, 4_000]) {
  t.test(`property: with ${leaseMs / 1000} s leases D never reads a lease P reaped (${SCHEDULES} schedules)`, async (t) => {
    const out = tally(leaseMs, realCheck)
    t.comment(JSON.stringify({ ...out, violations: out.violations.length }))
    t.same(out.violations.slice(0, 5), [], 'no ok after P reaped')
    t.equal(out.reads, SCHEDULES)
    // Not vacuous: P did reap leases D still held, and a check that always fails is caught.
    t.ok(out.reapedUnderPull > SCHEDULES / 20, `P reaped under live pulls (${out.reapedUnderPull})`)
    t.ok(out.readsOk > SCHEDULES / 10, `some reads succeed (${out.readsOk})`)
    if (leaseMs === 4_000) t.ok(out.oksPastE0 > 0, 'heartbeats carried some reads past the original expiry')
    // 1 s: the bound (2 × ≤1 s − 2 s)/3 ≤ 0, so D never counts on an extension.
    else t.equal(out.oksPastE0, 0)
  })
}

t.test(`property: router releases of undispatched leases and a slow P that drains before it reaps keep D safe (${SCHEDULES} schedules)`, async (t) => {
  const out = tally(4_000, realCheck, { router: 'undispatched', slowP: 'drain_first' })
  t.comment(JSON.stringify({ ...out, violations: out.violations.length }))
  t.same(out.violations.slice(0, 5), [], 'no ok after P ended the lease')
  t.ok(out.releasedBeforeDispatch > SCHEDULES / 5, `the router released leases (${out.releasedBeforeDispatch})`)
  t.ok(out.readsOk > SCHEDULES / 20, `some reads succeed (${out.readsOk})`)
  t.ok(out.oksPastE0 > 0, 'queued heartbeats still carried reads past the original expiry')
})

t.test('property harness has teeth: broken rules are caught', async (t) => {
  const broken: Record<string, Check> = {
    'ignores failed sends': (now, input) =>
      checkLease(now, { ...input, heartbeats: input.heartbeats && { ...input.heartbeats, failed: false } }).ok,
    'no margin': (now, input) => checkLease(now, { ...input, expiry: { ...input.expiry, uncertaintyMs: 0 }, safetyMs: 0 }).ok,
    'twice the bound': (now, input) => {
      const d = leaseDeadline(input)
      return now < (d.chain === 'unbroken' && d.boundMs !== undefined ? d.deadline + d.boundMs : d.deadline)
    },
  }
  for (const [name, check] of Object.entries(broken)) {
    const out = tally(4_000, check)
    t.ok(out.violations.length > 0, `${name}: ${out.violations.length} violations`)
  }
  t.equal(tally(4_000, () => false).readsOk, 0, 'an always-failing check would fail the "some reads succeed" assertion')
  // The rules outside D's check: a router that releases leases D is reading, and a P that
  // reaps before applying the heartbeats that reached it.
  const released = tally(4_000, realCheck, { router: 'any' })
  t.ok(released.releasedUnderPull > 0 && released.violations.length > 0, `router releases under a pull: ${released.violations.length} violations`)
  const reapFirst = tally(4_000, realCheck, { slowP: 'reap_first' })
  t.ok(reapFirst.violations.length > 0, `a slow P that reaps first: ${reapFirst.violations.length} violations`)
})
