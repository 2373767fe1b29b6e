import t from 'tap'
import { freePort } from '../../common/ports.js'
import { needNixl, probeNixl } from '../native/helpers.js'
import { get } from '../helpers/cluster.js'
import { complete, completionBody, metric, startEngine, startRouterProcess, within, type Outcome } from '../helpers/pd-agents.js'
import { report } from '../helpers/decoder-stall.js'

/*
 * Issue 17 item 6, a tombstone lifts when the same engine_id is seen alive again: a prefiller
 * with a configured engine_id (vLLM's kv_transfer_config engine_id, the simulator's
 * --engine-id) crashes, the router sees its connections refused and declares it gone, and the
 * decoder's agent tombstones it (10 minutes of failing fast). It comes back under the same
 * engine_id: its first prefill answer names it, the router logs peer_alive, and the decoder
 * reads from it again. Before, every request after the restart failed with XFA_ERR_PEER_GONE
 * until the tombstone expired.
 */

const probe = await probeNixl()
const LEASE_S = 10
const probes = { health: { intervalMs: 200, timeoutMs: 150, unhealthyThreshold: 2, baseEjectionMs: 500, maxEjectionMs: 1000 } }

t.test('a prefiller back under its configured engine_id after a crash serves P/D again', { skip: needNixl(t, probe) }, async (t) => {
  const port = await freePort()
  const agentArgs = ['--router-url', `http://127.0.0.1:${port}`]
  const prefill = await startEngine(t, { role: 'prefill', leaseSeconds: LEASE_S, agentArgs, simArgs: ['--engine-id', 'p-fixed'] })
  const decode = await startEngine(t, { role: 'decode', leaseSeconds: LEASE_S, agentArgs, simArgs: ['--kv-load-failure-policy', 'fail'] })
  const router = await startRouterProcess(t, [prefill, decode], { port, adminToken: 'admin-token-alive', ...probes })
  t.ok((await within(15_000, async () => (await get(`${decode.agent.url}/v1/status`)).json<{ router: { connected: boolean } }>().router.connected)) >= 0, 'the decoder follows the router')
  for (let i = 0; i < 4; i++) t.ok((await complete(router.url, completionBody(i, 'before'), i)).ok, 'served before the crash')

  await prefill.kill()
  const gone = await within(10_000, async () => (await metric(decode.agent.url, 'handoff_agent_peer_releases_total', { reason: 'peer_gone' })) >= 1)
  t.ok(gone >= 0, 'refused connections, no agent stream: declared gone, and the decoder released it')
  await prefill.startAgent()
  await prefill.startSim()
  // Back in routing (its probes pass): from here requests go through P, not D alone.
  const ready = async (): Promise<boolean> =>
    (await get(`${router.url}/topology`, { authorization: 'Bearer admin-token-alive' })).json<{ instances: { id: string; state: string }[] }>().instances.some((i) => i.id === 'prefill-0' && i.state === 'ready')
  t.ok((await within(10_000, ready)) >= 0, 'the prefiller is back in routing')
  const pullsBack = await metric(decode.agent.url, 'handoff_agent_pulls_total', { outcome: 'ok' })

  const outcomes: Outcome[] = []
  const back = await within(20_000, async () => {
    const o = await complete(router.url, completionBody(100 + outcomes.length, 'back'), outcomes.length)
    outcomes.push(o)
    return o.ok
  })
  t.ok(back >= 0, `served again after ${outcomes.length} request(s)`)
  const early = outcomes.length
  for (let i = 0; i < 32; i++) outcomes.push(await complete(router.url, completionBody(200 + i, 'after'), 200 + i))
  const s = report(t, 'prefiller back under its engine_id', outcomes)
  t.equal(s.wrong, 0, 'no wrong text')
  t.ok(early <= 3, `at most the first requests, racing the event, failed (${early - 1})`)
  t.ok(outcomes.slice(early).every((o) => o.ok), 'every request after that succeeded')
  t.ok(outcomes.length - early >= 30, `at least 30 after (${outcomes.length - early})`)
  t.ok((await metric(router.url, 'handoff_router_events_total', { type: 'peer_alive' })) >= 1, 'the router logged peer_alive')
  const pulls = (await metric(decode.agent.url, 'handoff_agent_pulls_total', { outcome: 'ok' })) - pullsBack
  t.ok(pulls >= 30, `and P/D resumed: the decoder READ the prefiller's KV again (${pulls} pulls), no local prefill in its place`)
})
