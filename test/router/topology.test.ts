import t from 'tap'
import { get, post, startRouter, startSim } from '../helpers/cluster.js'

const ADMIN = 'admin-token-123'
const auth = { authorization: `Bearer ${ADMIN}` }

t.test('GET /topology: instances with engine_ids and agents, pairings, event log position; admin only', async (t) => {
  const p = await startSim(t, ['--role', 'prefill'])
  const d1 = await startSim(t, ['--role', 'decode'])
  const d2 = await startSim(t, ['--role', 'decode'])
  const { url } = await startRouter(
    t,
    [
      { id: 'p0', role: 'prefill', url: p.url, labels: { transfer_group: 'a' } },
      { id: 'd0', role: 'decode', url: d1.url, labels: { transfer_group: 'a' } },
      { id: 'd1', role: 'decode', url: d2.url, labels: { transfer_group: 'b' } },
    ],
    { adminToken: ADMIN, pairing: { mode: 'label', label: 'transfer_group' } },
  )
  t.equal((await get(`${url}/topology`)).status, 401, 'no token: 401')
  t.equal((await get(`${url}/topology`, { authorization: 'Bearer wrong-token-x' })).status, 401, 'wrong token: 401')

  // One request through p0 teaches the router p0's engine_id; an agent registers for d0.
  const r = await post(`${url}/v1/completions`, { model: 'handoff/sim-1', prompt: 'hello there', max_tokens: 2 })
  t.equal(r.status, 200)
  const reg = await post(`${url}/v1/agents`, { agentId: 'agent-d0', engineId: 'eng-d0', role: 'decode', agentUrl: 'http://127.0.0.1:7601', engineUrl: d1.url })
  t.equal(reg.status, 200)
  t.match(reg.json(), { agentId: 'agent-d0', instanceId: 'd0' })

  const topo = (await get(`${url}/topology`, auth)).json<{
    instances: { id: string; engineId: string | null; engineIds: string[]; sharedRanks: boolean; state: string; agents: { agentId: string; peerAddress: string }[] }[]
    pairing: { mode: string; pairs: [string, string][] }
    events: { first: number; last: number }
  }>()
  const byId = new Map(topo.instances.map((i) => [i.id, i]))
  t.match(byId.get('p0')?.engineId, /^sim-/, "p0's engine_id was learned from its prefill answer")
  t.same(byId.get('p0')?.engineIds, [byId.get('p0')?.engineId], 'the set of its engine_ids: one engine behind the URL')
  t.equal(byId.get('p0')?.sharedRanks, false)
  t.equal(byId.get('d0')?.engineId, null, "d0's agent claims one, but only the engine's own answers name it (issue 18 item 2)")
  t.same(byId.get('d0')?.agents.map((a) => [a.agentId, a.peerAddress]), [['agent-d0', '127.0.0.1:7601']])
  t.equal(byId.get('d1')?.state, 'ready')
  t.same(topo.pairing.pairs, [['p0', 'd0']], 'label pairing: p0 pairs only with d0')
  t.same(topo.events, { first: 1, last: 0 }, 'nothing logged yet')
})

t.test('control endpoints are off without an admin token', async (t) => {
  const sim = await startSim(t)
  const { url } = await startRouter(t, [{ id: 'b0', role: 'both', url: sim.url }])
  const res = await get(`${url}/topology`, auth)
  t.equal(res.status, 403)
  t.equal(res.json<{ error: { code: string } }>().error.code, 'RTR_ERR_ADMIN_DISABLED')
})

t.test('an agent registration never brings an engine into the topology, token or not (issue 18 item 2)', async (t) => {
  const p = await startSim(t, ['--role', 'prefill'])
  const d = await startSim(t, ['--role', 'decode'])
  const agentAuth = { authorization: 'Bearer agent-token-123' }
  const { url } = await startRouter(t, [{ id: 'p0', role: 'prefill', url: p.url }], { adminToken: ADMIN, agentToken: 'agent-token-123' })
  t.equal((await post(`${url}/v1/completions`, { model: 'handoff/sim-1', prompt: 'x', max_tokens: 2 })).status, 503, 'no decoder yet')
  // The reproduction: an engineUrl of the caller's choosing became a routable instance, and the
  // router sent it real client prompts (and would have sent upstreamApiKey).
  const reg = await post(`${url}/v1/agents`, { agentId: 'agent-d', engineId: 'eng-d', role: 'decode', agentUrl: 'http://127.0.0.1:7602', engineUrl: d.url }, agentAuth)
  t.equal(reg.status, 200)
  t.match(reg.json(), { instanceId: null }, 'registered, attached to nothing')
  const topo = (await get(`${url}/topology`, auth)).json<{ instances: { id: string }[]; unattachedAgents: { agentId: string }[] }>()
  t.same(topo.instances.map((i) => i.id), ['p0'], 'no instance was added')
  t.match(topo.unattachedAgents, [{ agentId: 'agent-d' }])
  t.equal((await post(`${url}/v1/completions`, { model: 'handoff/sim-1', prompt: 'y', max_tokens: 2 })).status, 503, 'and nothing is routed to it')
  // Instances come from config, discovery or the admin API; the agent then attaches to one.
  t.equal((await post(`${url}/admin/instances`, { id: 'd0', role: 'decode', url: d.url }, auth)).status, 201)
  const again = await post(`${url}/v1/agents`, { agentId: 'agent-d', engineId: 'eng-d', role: 'decode', agentUrl: 'http://127.0.0.1:7602', engineUrl: d.url }, agentAuth)
  t.match(again.json(), { instanceId: 'd0' }, 'attaches once an instance is there')
  t.equal((await post(`${url}/v1/completions`, { model: 'handoff/sim-1', prompt: 'z', max_tokens: 2 })).status, 200)
})
