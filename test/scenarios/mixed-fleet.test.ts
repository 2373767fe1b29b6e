import t from 'tap'
import { freePort } from '../../common/ports.js'
import { get, spawnRouter } from '../helpers/cluster.js'
import { metric, REUSING_PREFILLER, startEngine, startUncheckedDecoder, within } from '../helpers/pd-agents.js'
import { noWrongText, timedRun } from '../helpers/stall.js'
import { needNixl, probeNixl } from '../native/helpers.js'

/*
 * Issue 37 item 2, with real KV bytes: the documented mixed fleet (leases.readCheck auto, an
 * agent token), one decoder with a transfer agent that follows the router (it checks its own
 * reads: the router trusts it) and one stock decoder (its agent checks nothing and is not
 * registered: the router checks it). The agent-backed decoder's engine is killed but kept in
 * routing, so about half the requests pick it first, are refused, and go to the stock one.
 * The stock decoder's agent stops 7 s under 5 s leases: P reaps and reuses the blocks of
 * what waits on it. A redirected leg must be checked as the stock decoder's own.
 */

const LEASE_S = 5
const AGENT = 'agent-token-mixed-fleet'
const probe = await probeNixl()

t.test('mixed fleet: legs redirected from an agent-backed decoder to a stock one are checked', { skip: needNixl(t, probe) }, async (t) => {
  const port = await freePort()
  const prefill = await startEngine(t, { role: 'prefill', leaseSeconds: LEASE_S, simArgs: [...REUSING_PREFILLER] })
  const backed = await startEngine(t, {
    role: 'decode',
    leaseSeconds: LEASE_S,
    simArgs: ['--kv-load-failure-policy', 'fail', '--agent-token', AGENT],
    agentArgs: ['--router-url', `http://127.0.0.1:${port}`, '--agent-token', AGENT],
  })
  const stock = await startUncheckedDecoder(t, LEASE_S)
  const router = await spawnRouter(t, {
    port,
    agentToken: AGENT,
    instances: [
      { id: 'prefill-0', role: 'prefill', url: prefill.sim.url },
      { id: 'backed', role: 'decode', url: backed.sim.url },
      { id: 'stock', role: 'decode', url: stock.sim.url },
    ],
    leases: { leaseSeconds: LEASE_S, marginMs: 1000, readCheck: 'auto' },
    // The dead decoder stays in routing: neither probes nor refused connections take it out.
    health: { intervalMs: 60_000, unhealthyThreshold: 1000 },
  })
  const connected = await within(15_000, async () => (await get(`${backed.agent.url}/v1/status`, { authorization: `Bearer ${AGENT}` })).json<{ router: { connected: boolean } }>().router.connected)
  t.ok(connected >= 0, 'the agent-backed decoder’s agent follows the router')
  await backed.sim.stop()

  const outcomes = await timedRun(
    router.url,
    {
      totalMs: 11_000,
      everyMs: 150,
      burst: 2,
      steps: [
        [1000, () => void stock.agent.child.kill('SIGSTOP')],
        [8000, () => void stock.agent.child.kill('SIGCONT')],
      ],
      finally: () => void stock.agent.child.kill('SIGCONT'),
    },
    'mixed',
  )
  await noWrongText(t, 'mixed fleet, stock decoder stopped 7 s', outcomes, router.url)
  const redirected = await metric(router.url, 'handoff_router_upstream_errors_total', { leg: 'decode', code: 'RTR_ERR_UPSTREAM_UNAVAILABLE' })
  t.ok(redirected > 0, `legs were redirected from the dead decoder (${redirected})`)
})
