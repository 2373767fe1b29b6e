import type { Test } from 'tap'
import { freePort } from '../../common/ports.js'
import type { SpawnedService } from '../../common/spawn.js'
import { get } from './cluster.js'
import { complete, completionBody, type Engine, type Outcome, REUSING_PREFILLER, sleep, startEngine, startRouterProcess, tally, within } from './pd-agents.js'

/*
 * Issue 17 item 1: a slow decoder must never make the router end leases it is still reading.
 * These scenarios wire processes as production does: every agent follows the router's event
 * log (--router-url), so a lease the router releases really reaches P's agent and P reuses
 * the blocks at once (LIFO); the router probes its engines; the decoder's *engine* (not its
 * agent) is stopped, so its agent still runs the pull once the engine asks for it. Every
 * answer is compared with the oracle.
 */

/** P's lease here and at the router: a 2.2 s stall stays well inside it. */
export const LEASE_S = 5
export const ADMIN = 'admin-token-stall-0'
export const admin = { authorization: `Bearer ${ADMIN}` }

/**
 * Probe cadences. `fast` (every 200 ms, 150 ms timeout, two failures) catches a 2.2 s freeze
 * and is what the probe-down scenario tests. `lenient` is for scenarios that take the decoder
 * out by hand (delete, drain): there a fast probe only adds risk, since on a loaded 2-core CI
 * machine two 150 ms probe timeouts in a row can eject the *healthy* decoder too, and then
 * requests fail RTR_ERR_NO_INSTANCE for reasons the scenario is not about.
 */
export const PROBES = {
  fast: { intervalMs: 200, timeoutMs: 150, unhealthyThreshold: 2, baseEjectionMs: 1000, maxEjectionMs: 2000 },
  lenient: { intervalMs: 500, timeoutMs: 2000, unhealthyThreshold: 3, baseEjectionMs: 1000, maxEjectionMs: 2000 },
} as const

export interface StallCluster {
  router: SpawnedService
  prefill: Engine
  /** decoders[0] is the one the scenarios stall; its router id is `stalledId`. */
  decoders: [Engine, Engine]
  stalledId: string
}

/** One prefiller and two fail-policy decoders, their agents following one router with probes on. */
export async function stallCluster(t: Test, probes: keyof typeof PROBES = 'fast'): Promise<StallCluster> {
  const port = await freePort()
  const agentArgs = ['--router-url', `http://127.0.0.1:${port}`]
  const prefill = await startEngine(t, { role: 'prefill', leaseSeconds: LEASE_S, simArgs: [...REUSING_PREFILLER], agentArgs })
  const decoders: [Engine, Engine] = [
    await startEngine(t, { role: 'decode', leaseSeconds: LEASE_S, simArgs: ['--kv-load-failure-policy', 'fail'], agentArgs }),
    await startEngine(t, { role: 'decode', leaseSeconds: LEASE_S, simArgs: ['--kv-load-failure-policy', 'fail'], agentArgs }),
  ]
  const router = await startRouterProcess(t, [prefill, ...decoders], { port, adminToken: ADMIN, leases: { leaseSeconds: LEASE_S }, health: PROBES[probes] })
  const statuses = async (): Promise<{ router: { connected: boolean } }[]> =>
    Promise.all([prefill, ...decoders].map(async (e) => (await get(`${e.agent.url}/v1/status`)).json<{ router: { connected: boolean } }>()))
  const connected = await within(15_000, async () => (await statuses()).every((s) => s.router.connected))
  t.ok(connected >= 0, 'every agent follows the router')
  // startRouterProcess names instances by role and index.
  return { router, prefill, decoders, stalledId: 'decode-1' }
}

interface TopologyInstance {
  id: string
  state: string
  inflight: number
}

export async function instance(url: string, id: string): Promise<TopologyInstance | undefined> {
  const topo = (await get(`${url}/topology`, admin)).json<{ instances: TopologyInstance[] }>()
  return topo.instances.find((i) => i.id === id)
}

export interface StallRun {
  outcomes: Outcome[]
  /** Requests that were in flight on the stalled decoder when `during` ran. */
  heldOnStalled: number
}

/**
 * Traffic in bursts of `burst` every 150 ms for `totalMs`; the stalled decoder's engine gets
 * SIGSTOP at 500 ms and SIGCONT `stallMs` later. `during` runs once requests are held on it
 * (delete it, drain it, or only watch the probes mark it down).
 */
export async function stallTraffic(
  c: StallCluster,
  opts: { tag: string; stallMs: number; totalMs: number; burst?: number; during?: () => Promise<void> },
): Promise<StallRun> {
  const { router, decoders } = c
  const stalled = decoders[0].sim.child
  const pending: Promise<Outcome>[] = []
  const started = performance.now()
  let stopped = false
  let resumed = false
  let heldOnStalled = 0
  let during: Promise<void> | undefined
  let n = 0
  const resume = (): void => {
    if (stopped && !resumed) stalled.kill('SIGCONT')
    resumed = true
  }
  try {
    while (performance.now() - started < opts.totalMs) {
      const now = performance.now() - started
      // Right after the stop a double burst: more requests than the frozen decoder already
      // holds, so some reach it before its pull (least-outstanding picks it on ties).
      let burst = opts.burst ?? 4
      if (!stopped && now >= 500) {
        stalled.kill('SIGSTOP')
        stopped = true
        burst *= 2
      }
      for (let b = 0; b < burst; b++, n++) pending.push(complete(router.url, completionBody(n, opts.tag), n, 60_000))
      if (stopped && !during && now >= 640) {
        heldOnStalled = (await instance(router.url, c.stalledId))?.inflight ?? 0
        during = opts.during?.() ?? Promise.resolve()
      }
      if (stopped && !resumed && now >= 500 + opts.stallMs) resume()
      await sleep(150)
    }
  } finally {
    resume()
  }
  await during
  return { outcomes: await Promise.all(pending), heldOnStalled }
}

/** Prints `wrong text: N of M` and the failures by code; returns the tally. */
export function report(t: Test, name: string, outcomes: readonly Outcome[]): ReturnType<typeof tally> {
  const s = tally(outcomes)
  t.comment(`${name}: wrong text: ${s.wrong} of ${s.requests} (${s.ok} oracle text, ${s.failed} failed ${JSON.stringify(s.codes)})`)
  return s
}
