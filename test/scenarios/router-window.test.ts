import t from 'tap'
import type { Test } from 'tap'
import { spawnRouter } from '../helpers/cluster.js'
import { type Engine, REUSING_PREFILLER, startEngine, startUncheckedDecoder } from '../helpers/pd-agents.js'
import { slowHop } from '../helpers/slow-hop.js'
import { noWrongText, timedRun } from '../helpers/stall.js'
import { needNixl, probeNixl } from '../native/helpers.js'

/*
 * Issue 37 item 1: where the router checks a stock decoder's reads (leases.readCheck router),
 * its read window is the only guard against a late READ, and it must start when the router
 * *sent* the prefill leg. P starts its lease when it finishes the request; whatever delays
 * P's answer on its way to the router (a router pause, a slow hop) must not lengthen the
 * window past P's real expiry. Each case wires processes as production does: P with its
 * agent (reaps at expiry and reuses the blocks at once), a decoder whose agent reads without
 * checking (stock vLLM does not check in pull mode), and every answer compared with the oracle.
 */

const LEASE_S = 5
const MARGIN_MS = 1000
const probe = await probeNixl()

/** P (300 ms prefills, so many are in flight at any instant) and a decoder that checks no read. */
async function engines(t: Test): Promise<{ prefill: Engine; decode: Engine }> {
  const prefill = await startEngine(t, { role: 'prefill', leaseSeconds: LEASE_S, simArgs: [...REUSING_PREFILLER, '--prefill-delay-ms', '300'] })
  return { prefill, decode: await startUncheckedDecoder(t, LEASE_S) }
}

const routerConfig = (prefillUrl: string, decodeUrl: string) => ({
  instances: [
    { id: 'prefill-0', role: 'prefill', url: prefillUrl },
    { id: 'decode-0', role: 'decode', url: decodeUrl },
  ],
  leases: { leaseSeconds: LEASE_S, marginMs: MARGIN_MS, readCheck: 'router' },
  // Lenient probes: a 2 s hop or a paused router must not take an engine out of routing.
  health: { intervalMs: 1000, timeoutMs: 5000, unhealthyThreshold: 3 },
})

const sig = (e: { child: { kill(s: NodeJS.Signals): boolean } }, s: NodeJS.Signals) => () => void e.child.kill(s)

t.test('the router paused 3.5 s while prefills are in flight: no wrong text', { skip: needNixl(t, probe) }, async (t) => {
  const { prefill, decode } = await engines(t)
  const router = await spawnRouter(t, routerConfig(prefill.sim.url, decode.sim.url))
  // P finishes the prefills in flight at 1 s and starts their leases; the router reads those
  // answers only at 4.5 s. The decoder then reads at 7 s: past P's expiry (about 6.3 s), well
  // inside a window counted from the router's reading of P's answer (8.5 s).
  const outcomes = await timedRun(
    router.url,
    {
      totalMs: 9000,
      everyMs: 100,
      burst: 3,
      steps: [
        [1000, sig(router.service, 'SIGSTOP')],
        [4500, () => (router.service.child.kill('SIGCONT'), decode.agent.child.kill('SIGSTOP'))],
        [7000, sig(decode.agent, 'SIGCONT')],
      ],
      finally: () => (router.service.child.kill('SIGCONT'), decode.agent.child.kill('SIGCONT')),
    },
    'paused',
  )
  await noWrongText(t, 'router paused 3.5 s', outcomes, router.url)
})

t.test('P’s answers held 2 s by a hop on the way back: no wrong text', { skip: needNixl(t, probe) }, async (t) => {
  const { prefill, decode } = await engines(t)
  const hop = await slowHop(t, prefill.sim.url)
  hop.hold(2000)
  const router = await spawnRouter(t, routerConfig(hop.url, decode.sim.url))
  // Every answer of P reaches the router 2 s after P started its lease. The decoder stops from
  // 3 s to 7.5 s: P's leases of prefills that ended at about 1.5-2.5 s run out before it reads
  // them, yet a window counted from the router's reading of the answer is still open.
  const outcomes = await timedRun(
    router.url,
    {
      totalMs: 10_000,
      everyMs: 100,
      burst: 3,
      steps: [
        [3000, sig(decode.agent, 'SIGSTOP')],
        [7500, sig(decode.agent, 'SIGCONT')],
      ],
      finally: sig(decode.agent, 'SIGCONT'),
    },
    'hop',
  )
  await noWrongText(t, 'answers held 2 s', outcomes, router.url)
})
