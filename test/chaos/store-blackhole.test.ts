import t from 'tap'
import { setTimeout as sleep } from 'node:timers/promises'
import { startTcpProxy } from '../../bench/tcp-proxy.js'
import { get, post, spawnRouter, waitFor } from '../helpers/cluster.js'
import { startFollower } from '../helpers/follower.js'
import { needRedis, startRedis } from '../helpers/redis.js'

/*
 * Issue 21 item 1: the link between a router and Redis drops every packet for a while, with no
 * reset (a firewall, a dead switch port), then new connections get through again. Two router
 * processes on one redis-server; router A reaches it through a TCP proxy that blackholes
 * (bench/tcp-proxy.ts), router B directly. An agent (the vLLM connector's follower, a real
 * Python process) follows A. An event logged through B after the link healed must reach it
 * through A, and A's /ready must say degraded while its Redis link is dead.
 */
const ADMIN = 'admin-token-store-blackhole'
const AGENT = 'agent-token-store-blackhole'
const admin = { authorization: `Bearer ${ADMIN}` }
const agent = { authorization: `Bearer ${AGENT}` }

type Ready = { store?: { state: string } }

t.test('a blackholed router↔Redis link: events logged after it healed reach the router’s agents; /ready says degraded meanwhile', { skip: needRedis(t) }, async (t) => {
  const redis = await startRedis(t)
  const link = await startTcpProxy({ host: '127.0.0.1', port: redis.port }, (stop) => t.teardown(stop))
  const base = {
    adminToken: ADMIN,
    agentToken: AGENT,
    instances: [
      { id: 'p0', role: 'prefill', url: 'http://127.0.0.1:9' },
      { id: 'd0', role: 'decode', url: 'http://127.0.0.1:10' },
    ],
  }
  const a = await spawnRouter(t, { ...base, store: { kind: 'redis', url: `redis://127.0.0.1:${link.port}`, memberTtlMs: 3000 } })
  const b = await spawnRouter(t, { ...base, store: { kind: 'redis', url: redis.url, memberTtlMs: 3000 } })

  const follower = startFollower(t, { engineId: 'd-engine', routers: [a.url], token: AGENT })
  const got = (seq: number): boolean => follower.seqs().includes(seq)
  const streams = async (): Promise<number> =>
    (await get(`${a.url}/topology`, admin)).json<{ instances: { id: string; agents: { agentId: string; streams: number }[] }[] }>().instances.find((i) => i.id === 'd0')?.agents.find((x) => x.agentId === 'vllm-d-engine')?.streams ?? 0
  t.ok(await waitFor(async () => (await streams()) > 0, 15_000), 'the follower holds a stream at router A', { stderr: follower.stderr() })

  // Engines the routers know, so that ops can declare them gone.
  for (const [id, port] of [['p-old-1', 5701], ['p-old-2', 5702]] as const) {
    t.equal((await post(`${b.url}/v1/agents`, { agentId: `a-${id}`, engineId: id, role: 'prefill', agentUrl: `http://127.0.0.1:${port}` }, agent)).status, 200)
  }
  const gone = async (id: string): Promise<number> => (await post(`${b.url}/fault_tolerance/event`, { event_type: 'peer_gone', nodes: { engine_ids: [id] } }, admin)).json<{ seq: number }>().seq
  const first = await gone('p-old-1')
  t.ok(await waitFor(() => got(first), 10_000), `before the fault: seq ${first} reached the follower through A`)

  const storeState = async (): Promise<string | undefined> => (await get(`${a.url}/ready`)).json<Ready>().store?.state
  link.blackhole()
  const holed = Date.now()
  let degraded = false
  while (Date.now() - holed < 4000) {
    if ((await storeState()) === 'degraded') degraded = true
    await sleep(100)
  }
  t.ok(degraded, 'A’s /ready said its store was degraded while the link dropped everything')
  link.heal()
  const healed = Date.now()
  const second = await gone('p-old-2')
  const arrived = await waitFor(() => got(second), 15_000)
  t.ok(arrived, `after the link healed: seq ${second}, logged through B, reached the follower through A (${arrived ? `${Date.now() - healed} ms after the heal` : 'not within 15 s'})`, { stderr: follower.stderr() })
  t.ok(await waitFor(async () => (await storeState()) === 'ok', 10_000), 'and A’s store is ok again')
  const metrics = (await get(`${a.url}/metrics`)).text
  const lost = Number(/^handoff_router_store_connections_lost_total\{connection="reader"\} (\d+)/m.exec(metrics)?.[1] ?? 0)
  t.ok(lost >= 1, `A counted its lost reader connections (${lost})`)
  t.same(follower.seqs(), [first, second], 'each event once, in order')
})
