import t, { type Test } from 'tap'
import type { AddressInfo } from 'node:net'
import { loadConfig } from '../../router/src/config.js'
import type { RouterConfig } from '../../schemas/router-config.js'
import { concretePath, errorCode, rawRequest, recordedRouter } from '../helpers/route-auth.js'

/*
 * Issue 18 §4–5: the router's planes. Engines' preStop hooks get a drain-only credential
 * instead of the admin token, and with `adminPort` / `agentPort` the operations and agent
 * planes answer on their own listeners only (so a NetworkPolicy can keep clients off them):
 * on any other port their routes do not exist, whatever the credential. Walks the router's
 * own route table, so a route added to a plane is covered.
 */

const ADMIN = 'admin-token-0123'
const AGENT = 'agent-token-0123'
const DRAIN = 'drain-token-0123'
const PROBES = new Set(['/health', '/livez', '/ready', '/readyz', '/metrics'])
const DRAIN_ROUTE = '/admin/instances/:id/drain'

type Plane = 'operations' | 'agents' | 'data' | 'probes'
const planeOf = (url: string): Plane =>
  PROBES.has(url) ? 'probes' : url === '/v1/agents' || url.startsWith('/v1/agents/') ? 'agents' : url.startsWith('/v1/') ? 'data' : 'operations'
const CREDENTIAL: Record<Plane, Record<string, string>> = {
  operations: { authorization: `Bearer ${ADMIN}` },
  agents: { authorization: `Bearer ${AGENT}` },
  data: {},
  probes: {},
}

async function router(t: Test, extra: Partial<RouterConfig>) {
  const { app, routes } = await recordedRouter(t, { adminToken: ADMIN, agentToken: AGENT, ...extra })
  await app.listen({ host: '127.0.0.1', port: 0 })
  const planes = await app.listenPlanes()
  t.teardown(() => app.close())
  const port = (app.server.address() as AddressInfo).port
  return { app, routes, port, planes }
}

t.test('a drain token drains, and opens nothing else', async (t) => {
  const { app, routes, port } = await router(t, { drainTokens: [DRAIN] })
  const ops = routes.filter((r) => planeOf(r.url) === 'operations' && r.method !== 'HEAD')
  t.ok(ops.some((r) => r.url === DRAIN_ROUTE) && ops.length > 5, `${ops.length} operations routes`)
  for (const r of ops) {
    if (r.url === DRAIN_ROUTE) continue
    const res = await rawRequest(port, r.method, concretePath(r.url), { authorization: `Bearer ${DRAIN}` })
    t.equal(res.status, 401, `${r.method} ${r.url} with the drain token: 401`)
    t.equal(errorCode(res.body), 'RTR_ERR_ADMIN_UNAUTHORIZED')
  }
  t.same(app.topology.snapshot().instances.map((i) => [i.id, i.draining]), [['d0', false]], 'nothing changed')
  const drained = await rawRequest(port, 'POST', '/admin/instances/d0/drain', { authorization: `Bearer ${DRAIN}` })
  t.equal(drained.status, 202, drained.body)
  t.notOk(app.topology.snapshot().instances.some((i) => i.id === 'd0' && !i.draining), 'the drain token drained d0 (nothing held: already removed)')
  const wrong = await rawRequest(port, 'POST', '/admin/instances/d0/drain', { authorization: 'Bearer drain-token-wrong' })
  t.equal(wrong.status, 401, 'another token does not')
})

t.test('with adminPort and agentPort, each plane answers on its own listener only', async (t) => {
  const { routes, port, planes } = await router(t, { adminPort: 0, agentPort: 0 })
  t.ok(planes.admin && planes.agents, `listeners: ${JSON.stringify(planes)}`)
  const portOf = { main: port, admin: Number(new URL(planes.admin as string).port), agents: Number(new URL(planes.agents as string).port) }
  t.equal(new Set(Object.values(portOf)).size, 3, 'three ports')
  const home: Record<Plane, (keyof typeof portOf)[]> = { data: ['main'], operations: ['admin'], agents: ['agents'], probes: ['main', 'admin', 'agents'] }
  let tried = 0
  for (const r of routes.filter((x) => x.method !== 'HEAD')) {
    const plane = planeOf(r.url)
    for (const listener of Object.keys(portOf) as (keyof typeof portOf)[]) {
      const res = await rawRequest(portOf[listener], r.method, concretePath(r.url), CREDENTIAL[plane])
      tried++
      const code = errorCode(res.body)
      if (home[plane].includes(listener)) {
        t.not(code, 'RTR_ERR_ROUTE_NOT_FOUND', `${r.method} ${r.url} is served on the ${listener} port (${res.status})`)
        t.not(res.status, 401, `${r.method} ${r.url} on the ${listener} port takes its credential`)
      } else {
        t.equal(res.status, 404, `${r.method} ${r.url} does not exist on the ${listener} port`)
        t.equal(code, 'RTR_ERR_ROUTE_NOT_FOUND')
      }
    }
  }
  t.ok(tried > 50, `${tried} requests`)
})

t.test('a plane port equal to the main port is a config error', async (t) => {
  t.throws(() => loadConfig({ overrides: { port: 8000, adminPort: 8000 } as never }), { code: 'RTR_ERR_CONFIG', message: /adminPort/ })
  t.throws(() => loadConfig({ overrides: { port: 8000, adminPort: 8100, agentPort: 8100 } as never }), { code: 'RTR_ERR_CONFIG', message: /agentPort/ })
})
