import t from 'tap'
import { setTimeout as sleep } from 'node:timers/promises'
import { freePort } from '../../common/ports.js'
import { get, post, startRouter, waitFor } from '../helpers/cluster.js'
import { startFollower } from '../helpers/follower.js'
import { needRedis, startRedis } from '../helpers/redis.js'

/*
 * Issue 20: handoff's vLLM connector follows the router's agent event stream from inside the
 * engine (transfer-agent/vllm/handoff_vllm/follower.py, stdlib only). Here its follower runs
 * without vLLM against two real routers on one real Redis, as production wires it: every
 * router URL tried in turn, registration as a `vllm-connector`, each event received once and
 * in order, acknowledged, and a router that goes away costs nothing (resume by sequence on
 * the other one).
 */
const ADMIN = 'admin-token-follower'
const AGENT = 'agent-token-follower'
const admin = { authorization: `Bearer ${ADMIN}` }
const agent = { authorization: `Bearer ${AGENT}` }

const instances = [
  { id: 'p0', role: 'prefill' as const, url: 'http://127.0.0.1:9' },
  { id: 'd0', role: 'decode' as const, url: 'http://127.0.0.1:10' },
]

t.test('the connector’s follower: every router in turn, each event once, acknowledged, across a failover', { skip: needRedis(t) }, async (t) => {
  const redis = await startRedis(t)
  const store = { kind: 'redis', url: redis.url, memberTtlMs: 900 }
  const a = await startRouter(t, instances, { probe: false, adminToken: ADMIN, agentToken: AGENT, store } as Parameters<typeof startRouter>[2])
  const b = await startRouter(t, instances, { probe: false, adminToken: ADMIN, agentToken: AGENT, store } as Parameters<typeof startRouter>[2])
  const dead = `http://127.0.0.1:${await freePort()}`
  const follower = startFollower(t, { engineId: 'd-engine', routers: [dead, a.url, b.url], token: AGENT })
  const { lines, seqs, stderr } = follower

  const topologyAgent = async (url: string) => {
    const res = await get(`${url}/topology`, admin)
    const d0 = res.json<{ instances: { id: string; agents: { agentId: string; kind: string; acked: number | null; streams: number }[] }[] }>().instances.find((i) => i.id === 'd0')
    return d0?.agents.find((x) => x.agentId === 'vllm-d-engine')
  }
  const registered = await waitFor(async () => ((await topologyAgent(a.url))?.streams ?? 0) > 0, 15_000)
  t.ok(registered, 'past the dead first URL, it registered with the next router and opened its stream', { stderr: stderr() })
  t.match(await topologyAgent(a.url), { kind: 'vllm-connector' }, 'as a vLLM connector, tied to the decoder at its engine URL')

  // Engines the routers know (an agent registered them), then declared gone by ops.
  for (const [id, port] of [['p-old-1', 5701], ['p-old-2', 5702]] as const) {
    t.equal((await post(`${a.url}/v1/agents`, { agentId: `a-${id}`, engineId: id, role: 'prefill', agentUrl: `http://127.0.0.1:${port}` }, agent)).status, 200)
  }
  const first = (await post(`${a.url}/fault_tolerance/event`, { event_type: 'peer_gone', nodes: { engine_ids: ['p-old-1'] } }, admin)).json<{ seq: number }>()
  t.ok(await waitFor(() => seqs().includes(first.seq), 10_000), `peer_gone seq ${first.seq} reached the follower`)
  t.ok(await waitFor(async () => (await topologyAgent(a.url))?.acked === first.seq, 10_000), 'and was acknowledged')

  // Router a goes away; b has the same log. What is logged meanwhile arrives once, after seq 1.
  await a.app.close()
  const second = (await post(`${b.url}/fault_tolerance/event`, { event_type: 'peer_gone', nodes: { engine_ids: ['p-old-2'] } }, admin)).json<{ seq: number }>()
  t.ok(await waitFor(() => seqs().includes(second.seq), 15_000), `peer_gone seq ${second.seq}, logged while its router was gone, reached it through the other router`, { stderr: stderr() })
  t.ok(await waitFor(async () => (await topologyAgent(b.url))?.acked === second.seq, 10_000), 'and was acknowledged there')
  await sleep(300)
  t.same(seqs(), [first.seq, second.seq], 'each event exactly once, in order (the resume named the last sequence received)')
  t.notOk(lines.some((l) => l.new_log), 'the same log all along: no start over')
  t.match(
    lines.find((l) => l.event?.seq === second.seq)?.event,
    { type: 'peer_gone', engineIds: ['p-old-2'] },
  )
})
