import Fastify from 'fastify'
import t, { type Test } from 'tap'
import { request } from 'undici'
import { get, post, startRouter, startSim, waitFor, type Posted } from '../helpers/cluster.js'

/*
 * Autoscaler hooks with real simulator processes behind an in-process router: register an
 * instance at runtime, drain a prefiller under load without failing a request (the drain
 * call with wait answers drained), a drain that runs out of time says what was left, bad
 * input is 400 coded, no token is 401, and no control call makes the router dial an address
 * that is not in its topology.
 */
const ADMIN = 'admin-token-123'
const auth = { authorization: `Bearer ${ADMIN}` }
const MODEL = 'handoff/sim-1'

async function del(url: string, headers: Record<string, string> = auth): Promise<Posted> {
  const res = await request(url, { method: 'DELETE', headers })
  const text = await res.body.text()
  return { status: res.statusCode, headers: res.headers, text, json: <T>() => JSON.parse(text) as T }
}

/** An HTTP server that answers like an engine and records every request it gets. */
async function recorder(t: Test): Promise<{ url: string; hits: string[] }> {
  const hits: string[] = []
  const app = Fastify()
  app.addHook('onRequest', async (req) => {
    hits.push(`${req.method} ${req.url}`)
  })
  app.get('/health', async () => ({}))
  app.get('/v1/models', async () => ({ object: 'list', data: [{ id: 'other-model', object: 'model' }] }))
  const url = await app.listen({ host: '127.0.0.1', port: 0 })
  t.teardown(() => app.close())
  return { url, hits }
}

const [p0, p1, slow, d0] = await Promise.all([
  startSim(t, ['--role', 'prefill', '--prefill-delay-ms', '150', '--engine-id', 'eng-p0']),
  startSim(t, ['--role', 'prefill', '--prefill-delay-ms', '150', '--engine-id', 'eng-p1']),
  startSim(t, ['--role', 'prefill', '--prefill-delay-ms', '1500', '--engine-id', 'eng-slow']),
  startSim(t, ['--role', 'decode', '--decode-delay-ms', '5']),
])

t.test('control endpoints need the admin token; without one configured they are off', async (t) => {
  const { url } = await startRouter(t, [{ id: 'd0', role: 'decode', url: d0.url }], { adminToken: ADMIN, probe: false })
  const calls: [string, () => Promise<Posted>][] = [
    ['register', () => post(`${url}/admin/instances`, { id: 'x', role: 'decode', url: d0.url })],
    ['drain', () => post(`${url}/admin/instances/d0/drain`, {})],
    ['delete', () => del(`${url}/admin/instances/d0`, {})],
    ['leases', () => get(`${url}/leases`)],
  ]
  for (const [name, call] of calls) {
    const res = await call()
    t.equal(res.status, 401, name)
    t.equal(res.json<{ error: { code: string } }>().error.code, 'RTR_ERR_ADMIN_UNAUTHORIZED', name)
  }
  const wrong = await get(`${url}/leases`, { authorization: 'Bearer not-the-token' })
  t.equal(wrong.status, 401)
  const off = await startRouter(t, [{ id: 'd0', role: 'decode', url: d0.url }], { probe: false })
  const res = await get(`${off.url}/leases`, auth)
  t.equal(res.status, 403)
  t.equal(res.json<{ error: { code: string } }>().error.code, 'RTR_ERR_ADMIN_DISABLED')
})

t.test('bad input is 400 coded; unknown ids 404; a duplicate id 409', async (t) => {
  const { url } = await startRouter(t, [{ id: 'd0', role: 'decode', url: d0.url }], { adminToken: ADMIN, probe: false })
  const cases: [string, string, unknown, number, string][] = [
    ['POST', '/admin/instances', { id: 'x', role: 'decode' }, 400, 'RTR_ERR_INVALID_REQUEST'],
    ['POST', '/admin/instances', { id: 'x', role: 'leader', url: 'http://127.0.0.1:9' }, 400, 'RTR_ERR_INVALID_REQUEST'],
    ['POST', '/admin/instances', { id: 'x', role: 'decode', url: 'ftp://127.0.0.1:9' }, 400, 'RTR_ERR_INVALID_REQUEST'],
    ['POST', '/admin/instances', { id: 'has space', role: 'decode', url: 'http://127.0.0.1:9' }, 400, 'RTR_ERR_INVALID_REQUEST'],
    ['POST', '/admin/instances', { id: 'x', role: 'decode', url: 'http://127.0.0.1:9', extra: 1 }, 400, 'RTR_ERR_INVALID_REQUEST'],
    ['POST', '/admin/instances', '{"id": ', 400, 'RTR_ERR_INVALID_JSON'],
    ['POST', '/admin/instances', { id: 'd0', role: 'decode', url: 'http://127.0.0.1:9' }, 409, 'RTR_ERR_INSTANCE_EXISTS'],
    ['POST', '/admin/instances/d0/drain', { wait: 'yes' }, 400, 'RTR_ERR_INVALID_REQUEST'],
    ['POST', '/admin/instances/d0/drain', { timeoutMs: 0 }, 400, 'RTR_ERR_INVALID_REQUEST'],
    ['POST', '/admin/instances/d0/drain', { timeoutMs: 600_001 }, 400, 'RTR_ERR_INVALID_REQUEST'],
    ['POST', '/admin/instances/d0/drain', { now: true }, 400, 'RTR_ERR_INVALID_REQUEST'],
    ['POST', '/admin/instances/nope/drain', {}, 404, 'RTR_ERR_INSTANCE_NOT_FOUND'],
    ['GET', '/leases?instance=bad%20id', undefined, 400, 'RTR_ERR_INVALID_REQUEST'],
    ['GET', '/leases?other=1', undefined, 400, 'RTR_ERR_INVALID_REQUEST'],
    ['DELETE', '/admin/instances/nope', undefined, 404, 'RTR_ERR_INSTANCE_NOT_FOUND'],
  ]
  for (const [method, path, body, status, code] of cases) {
    const res = method === 'POST' ? await post(`${url}${path}`, body, auth) : method === 'GET' ? await get(`${url}${path}`, auth) : await del(`${url}${path}`)
    t.equal(res.status, status, `${method} ${path} ${JSON.stringify(body)}`)
    t.equal(res.json<{ error: { code: string } }>().error.code, code)
  }
  const big = await post(`${url}/admin/instances`, { id: 'x', role: 'decode', url: 'http://127.0.0.1:9', labels: { pad: 'x'.repeat(17 * 1024 * 1024) } }, auth)
  t.equal(big.status, 413, 'bodies are size-limited')
  t.same((await get(`${url}/topology`, auth)).json<{ instances: { id: string }[] }>().instances.map((i) => i.id), ['d0'], 'nothing was added')
})

t.test('the router never dials an address outside its topology; POST /admin/instances is the way in', async (t) => {
  const outsider = await recorder(t)
  const { url } = await startRouter(t, [{ id: 'd0', role: 'decode', url: d0.url }], { adminToken: ADMIN, health: { intervalMs: 100, timeoutMs: 1000, unhealthyThreshold: 3, baseEjectionMs: 5000, maxEjectionMs: 120000 } })
  const host = new URL(outsider.url).host
  t.equal((await post(`${url}/fault_tolerance/event`, { event_type: 'peer_gone', nodes: { addresses: [host] } }, auth)).status, 202)
  t.equal((await post(`${url}/v1/agents`, { agentId: 'a-out', engineId: 'eng-out', role: 'decode', agentUrl: outsider.url, engineUrl: outsider.url })).status, 200)
  t.equal((await post(`${url}/admin/instances/d0/drain`, { wait: false }, auth)).status, 202, 'drain calls dial nothing either')
  await new Promise((r) => setTimeout(r, 400))
  t.same(outsider.hits, [], 'four probe rounds later: not one request')

  const res = await post(`${url}/admin/instances`, { id: 'out', role: 'decode', url: outsider.url, labels: { zone: 'a' } }, auth)
  t.equal(res.status, 201)
  t.match(res.json(), { id: 'out', role: 'decode', url: outsider.url, labels: { zone: 'a' }, healthy: true, models: ['other-model'] }, 'probed before the answer')
  t.ok(outsider.hits.includes('GET /health') && outsider.hits.includes('GET /v1/models'))
  const topo = (await get(`${url}/topology`, auth)).json<{ instances: { id: string; state: string }[] }>()
  t.match(
    topo.instances.find((i) => i.id === 'out'),
    { state: 'ready' },
  )
  const gone = await del(`${url}/admin/instances/out`)
  t.equal(gone.status, 200)
  t.match(gone.json(), { id: 'out', engineIds: [] }, "no peer_gone: the engine never answered, and an agent's claim is not its word")
  const before = outsider.hits.length
  await new Promise((r) => setTimeout(r, 300))
  t.equal(outsider.hits.length, before, 'deregistered: probes stop')
})

t.test('draining a prefiller under load: no request fails, the drain answers drained, the instance is gone', async (t) => {
  const { url, app } = await startRouter(t, [{ id: 'p0', role: 'prefill', url: p0.url }, { id: 'd0', role: 'decode', url: d0.url }], { adminToken: ADMIN })
  // The second prefiller joins at runtime.
  t.equal((await post(`${url}/admin/instances`, { id: 'p1', role: 'prefill', url: p1.url }, auth)).status, 201)
  // Six requests in flight at any time, each prefilled in 150 ms, until told to stop.
  const statuses: number[] = []
  let active = 0
  let sent = 0
  let stop = false
  const load = (async () => {
    const all: Promise<void>[] = []
    for (let i = 0; !stop; i++) {
      while (active >= 6) await new Promise((r) => setTimeout(r, 5))
      active++
      sent++
      const body = { model: MODEL, prompt: `request ${i} of the drain test`, max_tokens: 4, stream: i % 2 === 0 }
      all.push(
        post(`${url}/v1/completions`, body)
          .then((r) => void statuses.push(r.status), () => void statuses.push(-1))
          .finally(() => active--),
      )
    }
    await Promise.all(all)
  })()
  t.ok(await waitFor(async () => ((await app.leases.summary()).byPrefill.p0 ?? 0) > 0), 'a lease on p0 is unread')
  const drain = await post(`${url}/admin/instances/p0/drain`, { wait: true, timeoutMs: 15_000 }, auth)
  const afterDrain = sent
  await new Promise((r) => setTimeout(r, 400))
  stop = true
  await load
  t.equal(drain.status, 200)
  t.match(drain.json(), { id: 'p0', drained: true, removed: true, inflight: 0, unreadLeases: 0 })
  t.ok(sent > afterDrain, 'traffic went on during and after the drain')
  t.same(
    statuses.filter((s) => s !== 200),
    [],
    `all ${statuses.length} requests succeeded`,
  )
  const topo = (await get(`${url}/topology`, auth)).json<{ instances: { id: string }[] }>()
  t.same(
    topo.instances.map((i) => i.id),
    ['d0', 'p1'],
  )
  t.match(
    (await app.events.store.since(0)).filter((e) => e.type === 'peer_gone'),
    [{ engineIds: ['eng-p0'], reason: 'drained: instance p0' }],
  )
  t.same((await app.leases.summary()).inFlight, { issued: 0, reading: 0 })
})

t.test('a drain that runs out of time says what was left, and completes later', async (t) => {
  const { url } = await startRouter(t, [{ id: 'slow', role: 'prefill', url: slow.url }, { id: 'd0', role: 'decode', url: d0.url }], { adminToken: ADMIN })
  const inflight = post(`${url}/v1/completions`, { model: MODEL, prompt: 'held for 1.5 s on P', max_tokens: 2 })
  await new Promise((r) => setTimeout(r, 200))
  const timedOut = await post(`${url}/admin/instances/slow/drain`, { wait: true, timeoutMs: 300 }, auth)
  t.equal(timedOut.status, 200)
  t.match(timedOut.json(), { id: 'slow', drained: false, removed: false, inflight: 1, unreadLeases: 0 })
  t.ok(timedOut.json<{ waitedMs: number }>().waitedMs >= 290)
  const again = await post(`${url}/admin/instances/slow/drain`, {}, auth)
  t.equal(again.status, 202, 'without wait: accepted at once')
  t.match(again.json(), { drained: false, inflight: 1 })
  t.equal((await inflight).status, 200, 'the request in flight finished on the draining prefiller')
  t.ok(
    await waitFor(async () => !(await get(`${url}/topology`, auth)).json<{ instances: { id: string }[] }>().instances.some((i) => i.id === 'slow')),
    'then it left the topology',
  )
})
