import t from 'tap'
import { needNixl, probeNixl } from '../native/helpers.js'
import { get, post } from '../helpers/cluster.js'
import { complete, completionBody, sleep, within, type Outcome } from '../helpers/pd-agents.js'
import { admin, report, stallCluster } from '../helpers/decoder-stall.js'

/*
 * Issue 17 item 6, the address form of peer_gone: the prefiller restarts at the same
 * host:port under a new engine_id, and a late ops call names the address it saw the old
 * incarnation at. An address never resolves to an engine that is up and answering with its
 * engine_id: the router reports the live one as alive_skipped and logs nothing, so no
 * decoder tombstones it. Before the fix the new engine_id was logged gone, its pulls failed
 * with XFA_ERR_PEER_GONE for 10 minutes and the pair breaker stopped prefill offload.
 */

const probe = await probeNixl()

interface AgentStatus {
  engineId: string
  peers: { engineId: string; address: string }[]
}

t.test('a late peer_gone by address after a restart: the live engine is left alone', { skip: needNixl(t, probe) }, async (t) => {
  const c = await stallCluster(t)
  const { prefill, router } = c
  const outcomes: Outcome[] = []
  for (let i = 0; i < 6; i++) outcomes.push(await complete(router.url, completionBody(i, 'before'), i))
  const old = (await get(`${prefill.agent.url}/v1/status`)).json<AgentStatus>().engineId
  const simAddress = new URL(prefill.sim.url).host
  const agentAddress = new URL(prefill.agent.url).host

  await prefill.kill()
  await prefill.startAgent()
  await prefill.startSim()
  t.equal(new URL(prefill.sim.url).host, simAddress, 'the prefiller is back at the same address')
  const fresh = (await get(`${prefill.agent.url}/v1/status`)).json<AgentStatus>().engineId
  t.not(fresh, old, 'under a new engine_id')
  const back = await within(15_000, async () => (await complete(router.url, completionBody(99, 'back'), 99)).ok)
  t.ok(back >= 0, 'the router serves through the new incarnation')

  // Ops tooling that still has the old incarnation's addresses.
  const res = await post(`${router.url}/fault_tolerance/event`, { event_type: 'peer_gone', nodes: { addresses: [simAddress, agentAddress] }, reason: 'late cleanup' }, admin)
  t.equal(res.status, 202)
  const body = res.json<{ seq: number | null; engine_ids: string[]; alive_skipped: string[]; logged: boolean }>()
  t.comment(`ops answer: ${JSON.stringify(body)}`)
  t.same(body.alive_skipped, [fresh], 'the live engine at those addresses is reported, not declared gone')
  t.notOk(body.engine_ids.includes(fresh), 'and not in the event')

  await sleep(300)
  for (let i = 0; i < 36; i++) outcomes.push(await complete(router.url, completionBody(100 + i, 'after'), 100 + i))
  const s = report(t, 'late peer_gone by address after a restart', outcomes)
  t.ok(s.requests >= 30, `at least 30 requests (${s.requests})`)
  t.equal(s.wrong, 0, 'no wrong text')
  t.equal(s.failed, 0, 'no request failed: the live prefiller was not dropped')
  for (const d of c.decoders) {
    const peers = (await get(`${d.agent.url}/v1/status`)).json<AgentStatus>().peers
    t.notOk(peers.some((p) => p.engineId === old), 'the decoders no longer hold the old incarnation')
  }
})
