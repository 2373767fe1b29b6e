import { connect, createServer, type AddressInfo, type Socket } from 'node:net'
import { freePort } from '../../common/ports.js'
import type { FastifyInstance } from 'fastify'
import pino from 'pino'
import t from 'tap'
import { buildApp } from '../../router/src/app.js'
import { loadConfig } from '../../router/src/config.js'
import { systemClock } from '../../common/clock.js'
import { seededRandom } from '../../common/random.js'
import type { PeerGoneRequest } from '../../schemas/agent-api.js'
import { parseFrame, RouterLink } from '../../transfer-agent/src/router-link.js'
import { get, post, startRouter, waitFor } from '../helpers/cluster.js'

/*
 * The agent's router link against a real in-process router (no NIXL: the agent behind it is
 * a recording double): register, stream, apply, ack; failover to the next URL; a router that
 * restarted (another log) is applied from its start; a re-attach under another engine_id.
 */

const ADMIN = 'admin-token-0123'
const admin = { authorization: `Bearer ${ADMIN}` }

class Target {
  gone: PeerGoneRequest[] = []
  released: string[] = []
  held = new Set<string>(['r1', 'r2'])
  peerGone(req: PeerGoneRequest): Promise<void> {
    this.gone.push(req)
    return Promise.resolve()
  }
  release(id: string): boolean {
    this.released.push(id)
    return this.held.delete(id)
  }
}

const silent = { debug: () => {}, info: () => {}, warn: () => {}, error: () => {} }

function link(t: { teardown(fn: () => unknown): void }, urls: string[], target: Target, agentId = 'agent-1') {
  const counts: Record<string, number> = {}
  let connected = 0
  const l = new RouterLink({
    urls,
    agentId,
    clock: systemClock,
    random: seededRandom(1),
    log: silent,
    target,
    metrics: { events: { inc: ({ type }) => void (counts[type] = (counts[type] ?? 0) + 1) }, connected: { set: (v) => void (connected = v) } },
    backoffMinMs: 20,
    backoffMaxMs: 100,
  })
  t.teardown(() => l.close())
  return { link: l, counts, connected: () => connected }
}

/** A router at a fixed port (startRouter picks one), to restart it there. */
async function routerAt(t: { teardown(fn: () => unknown): void }, port: number): Promise<FastifyInstance> {
  const config = { ...loadConfig({ overrides: { port: 0, logLevel: 'warn' } }), instances: [], adminToken: ADMIN }
  const app = await buildApp({ config, logger: pino({ level: 'silent' }), probe: false })
  await app.listen({ host: '127.0.0.1', port })
  t.teardown(() => app.close())
  return app
}

t.test('register, stream, apply in order, ack; delivery completes', async (t) => {
  const { app, url } = await startRouter(t, [{ id: 'p', role: 'prefill', url: 'http://127.0.0.1:9' }], { probe: false, adminToken: ADMIN })
  const target = new Target()
  // A dead router first: the link fails over to the live one.
  const { link: l, counts, connected } = link(t, [`http://127.0.0.1:${await freePort()}`, url], target)
  t.equal(l.status().connected, false)
  l.attached({ engineId: 'p-1', role: 'prefill', agentUrl: 'http://127.0.0.1:7001', engineUrl: 'http://127.0.0.1:9' })
  t.ok(await waitFor(() => l.status().connected, 5000), 'connected after failing over')
  t.equal(connected(), 1, 'the gauge says so')
  t.equal(l.status().url, url)
  t.equal(app.events.agents.get('agent-1')?.instanceId, 'p', 'registered with its instance')

  await post(`${url}/v1/agents`, { agentId: 'other', engineId: 'd-9', role: 'decode', agentUrl: 'http://127.0.0.1:7009' })
  const res = await post(`${url}/fault_tolerance/event`, { event_type: 'peer_gone', nodes: { engine_ids: ['d-9'] } }, admin)
  const { seq } = res.json<{ seq: number }>()
  app.events.releaseLease({ prefillEngineId: 'p-1', requestIds: ['r1', 'r2', 'r3'], reason: 'client_gone' })
  app.events.releaseLease({ prefillEngineId: 'someone-else', requestIds: ['x'], reason: 'client_gone' })
  t.ok(await waitFor(() => l.status().lastApplied === 2 && l.status().lastAcked === 2, 5000), 'applied and acked both')
  t.same(target.gone, [{ engineIds: ['d-9'], reason: 'ops: no reason given' }], 'peer_gone by engine_ids')
  t.same(target.released, ['r1', 'r2', 'r3'], "lease_release for this agent's engine")
  t.same(counts, { peer_gone: 1, lease_release: 1 })
  t.match((await get(`${url}/fault_tolerance/events/${seq}`, admin)).json(), { applied: ['agent-1'], expected: ['agent-1', 'other'] })
  t.match(l.status(), { routerId: app.events.store.id, engineId: 'p-1' })

  // Another engine_id behind this agent: it registers again at once. That is a claim: the old
  // one is declared gone when the engine itself answers under the new one (issue 18 item 2).
  l.attached({ engineId: 'p-2', role: 'prefill', agentUrl: 'http://127.0.0.1:7001', engineUrl: 'http://127.0.0.1:9' })
  t.ok(await waitFor(() => app.events.agents.get('agent-1')?.engineId === 'p-2', 5000), 're-registered under the new engine_id')
  t.notOk(target.gone.some((g) => g.engineIds?.includes('p-1')), 'which declares nothing gone by itself')
  app.topology.observeEngineId('p', 'p-1')
  app.topology.observeEngineId('p', 'p-2')
  t.ok(await waitFor(() => target.gone.some((g) => g.engineIds?.includes('p-1')), 5000), "the engine's own answer does: the old engine_id came back as peer_gone")
  const before = l.status().lastApplied
  l.attached({ engineId: 'p-2', role: 'prefill', agentUrl: 'http://127.0.0.1:7001', engineUrl: 'http://127.0.0.1:9' })
  t.equal(l.status().lastApplied, before, 'the same registration again changes nothing')
})

t.test('a restarted router (another log) is applied from its start; the link reconnects', async (t) => {
  const port = await freePort()
  const first = await routerAt(t, port)
  const url = `http://127.0.0.1:${port}`
  const target = new Target()
  const { link: l } = link(t, [url], target)
  l.attached({ engineId: 'd-1', role: 'decode', agentUrl: 'http://127.0.0.1:7002' })
  t.ok(await waitFor(() => l.status().connected, 5000))
  for (const id of ['g1', 'g2', 'g3']) {
    await post(`${url}/v1/agents`, { agentId: `a-${id}`, engineId: id, role: 'prefill', agentUrl: `http://127.0.0.1:${7100 + Number(id.slice(1))}` })
    await post(`${url}/fault_tolerance/event`, { event_type: 'peer_gone', nodes: { engine_ids: [id] } }, admin)
  }
  t.ok(await waitFor(() => l.status().lastAcked === 3, 5000), 'applied 3 on the first router')
  const oldId = l.status().routerId

  await first.close()
  t.ok(await waitFor(() => !l.status().connected, 5000), 'the stream ended with the router')
  const second = await routerAt(t, port)
  t.ok(await waitFor(() => l.status().connected && l.status().routerId !== oldId, 5000), 'registered with the new router')
  t.equal(l.status().lastApplied, 0, 'the new log is applied from its start')
  t.ok(second.events.agents.get('agent-1'), 'the new router knows the agent again')
  await post(`${url}/v1/agents`, { agentId: 'a-new', engineId: 'g9', role: 'prefill', agentUrl: 'http://127.0.0.1:7199' })
  const res = await post(`${url}/fault_tolerance/event`, { event_type: 'peer_gone', nodes: { engine_ids: ['g9'] } }, admin)
  t.equal(res.json<{ seq: number }>().seq, 1, 'the new log starts at 1, below what the agent applied before')
  t.ok(await waitFor(() => target.gone.some((g) => g.engineIds?.includes('g9')), 5000), 'and the agent applies it')
  t.ok(await waitFor(() => l.status().lastAcked === 1, 5000), 'and acks it')
})

t.test('a router that forgot the agent (404 on acks) is registered with again', async (t) => {
  const { app, url } = await startRouter(t, [], { probe: false, adminToken: ADMIN })
  const target = new Target()
  const { link: l } = link(t, [url], target)
  l.attached({ engineId: 'd-1', role: 'decode', agentUrl: 'http://127.0.0.1:7002' })
  t.ok(await waitFor(() => l.status().connected, 5000))
  app.events.agents.remove('agent-1')
  await post(`${url}/v1/agents`, { agentId: 'a-x', engineId: 'gx', role: 'prefill', agentUrl: 'http://127.0.0.1:7300' })
  await post(`${url}/fault_tolerance/event`, { event_type: 'peer_gone', nodes: { engine_ids: ['gx'] } }, admin)
  t.ok(await waitFor(() => app.events.agents.get('agent-1') !== undefined && l.status().lastAcked === 1, 5000), 'registered again and acked')
})

/**
 * A TCP proxy in front of a router whose router-to-agent direction can be stopped: the agent
 * then reads nothing, as a stuck agent process would, while the router writes on.
 */
async function pausableProxy(t: { teardown(fn: () => unknown): void }, target: string): Promise<{ url: string; pause(): void; resume(): void }> {
  const { hostname, port } = new URL(target)
  const pairs: { from: Socket; to: Socket }[] = []
  let paused = false
  const server = createServer((client) => {
    const upstream = connect(Number(port), hostname)
    client.on('error', () => upstream.destroy())
    upstream.on('error', () => client.destroy())
    client.pipe(upstream)
    if (!paused) upstream.pipe(client)
    else upstream.pause()
    pairs.push({ from: upstream, to: client })
  })
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve))
  t.teardown(() => {
    for (const p of pairs) p.from.destroy()
    server.close()
  })
  return {
    url: `http://127.0.0.1:${(server.address() as AddressInfo).port}`,
    pause: () => {
      paused = true
      for (const p of pairs) {
        p.from.unpipe(p.to)
        p.from.pause()
      }
    },
    resume: () => {
      paused = false
      for (const p of pairs) p.from.pipe(p.to)
    },
  }
}

t.test('a stream the router cut (the agent read nothing for a while) resumes after the last applied event', async (t) => {
  const { app, url } = await startRouter(t, [], { probe: false, events: { keepAliveMs: 100, streamBufferBytes: 16384 } })
  const proxy = await pausableProxy(t, url)
  const target = new Target()
  const { link: l } = link(t, [proxy.url], target)
  l.attached({ engineId: 'p-cut', role: 'prefill', agentUrl: 'http://127.0.0.1:7401' })
  t.ok(await waitFor(() => l.status().connected, 5000))
  const release = (i: number) => ({ prefillEngineId: 'p-cut', requestIds: [`r${i}`, ...Array.from({ length: 40 }, (_, k) => `${'q'.repeat(200)}-${i}-${k}`)], reason: 'client_gone' })
  await app.events.releaseLease(release(0))
  t.ok(await waitFor(() => l.status().lastAcked === 1, 5000), 'the first event applied')
  proxy.pause()
  // About 9 KB each, 18 MB in all: more than the sockets between them hold.
  for (let i = 1; i < 2000; i++) await app.events.releaseLease(release(i))
  const cut = async () => /handoff_router_agent_streams_cut_total\{reason="stalled"\} 1/.test((await get(`${url}/metrics`)).text)
  t.ok(await waitFor(cut, 10_000), 'the router cut the stream that took nothing')
  const applied = l.status().lastApplied
  t.ok(applied < 2000, `the agent had applied ${applied} of 2000`)
  proxy.resume()
  t.ok(await waitFor(() => l.status().lastApplied === 2000 && l.status().lastAcked === 2000, 20_000), 'it reconnected and applied the rest')
  const ids = target.released.filter((id) => /^r\d+$/.test(id))
  t.same(ids, Array.from({ length: 2000 }, (_, i) => `r${i}`), 'every event once, in order: none lost, none applied twice')
  t.equal(app.events.agents.get('agent-1')?.streams, 1, 'one stream open again')
})

t.test('SSE frames', async (t) => {
  t.match(parseFrame('id: 3\ndata: {"seq":3,"type":"peer_gone","engineIds":[]}'), { seq: 3, type: 'peer_gone' })
  t.match(parseFrame('id: 3\r\ndata:{"seq":3,"type":"snapshot"}\r'), { seq: 3, type: 'snapshot' })
  t.equal(parseFrame(': keep-alive'), undefined)
  t.equal(parseFrame('data: not json'), undefined)
  t.equal(parseFrame('data: {"type":"x"}'), undefined, 'no sequence')
  t.throws(() => new RouterLink({ urls: [], agentId: 'a', clock: systemClock, random: seededRandom(1), log: silent, target: new Target() }), RangeError)
  t.throws(() => new RouterLink({ urls: ['ftp://x'], agentId: 'a', clock: systemClock, random: seededRandom(1), log: silent, target: new Target() }), RangeError)
})
