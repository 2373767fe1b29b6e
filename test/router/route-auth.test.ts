import t from 'tap'
import type { AddressInfo } from 'node:net'
import { concretePath, errorCode, rawRequest, recordedRouter, targetVariants } from '../helpers/route-auth.js'

/*
 * Issue 18 item 1, the router's side: with the admin token, the agent token and API keys all
 * set, every route of the router's own table except the probes needs its plane's credential,
 * under every target form a URL-prefix check would get wrong, and another plane's credential
 * does not open it. A route added outside the guarded plugins fails here.
 */

const ADMIN = 'admin-token-0123'
const AGENT = 'agent-token-0123'
const API_KEY = 'api-key-0123456'
const PUBLIC = new Set(['/health', '/livez', '/ready', '/readyz', '/metrics'])

type Plane = 'admin' | 'agents' | 'data'
const CREDENTIAL: Record<Plane, string> = { admin: ADMIN, agents: AGENT, data: API_KEY }
const REFUSAL: Record<Plane, string> = { admin: 'RTR_ERR_ADMIN_UNAUTHORIZED', agents: 'RTR_ERR_AGENT_UNAUTHORIZED', data: 'RTR_ERR_UNAUTHORIZED' }

/** DESIGN "Security": agents under /v1/agents, the data plane under the rest of /v1, the control plane everywhere else. */
const planeOf = (url: string): Plane => (url === '/v1/agents' || url.startsWith('/v1/agents/') ? 'agents' : url.startsWith('/v1/') ? 'data' : 'admin')

t.test('every guarded router route needs its own plane’s credential, in any target form', async (t) => {
  const { app, routes } = await recordedRouter(t, { adminToken: ADMIN, agentToken: AGENT, apiKeys: [API_KEY] })
  await app.listen({ host: '127.0.0.1', port: 0 })
  t.teardown(() => app.close())
  const { port } = app.server.address() as AddressInfo
  const origin = `http://127.0.0.1:${port}`
  const before = JSON.stringify(app.topology.snapshot().instances.map((i) => [i.id, i.draining]))

  const urls = new Set(routes.map((r) => r.url))
  for (const u of [...PUBLIC, '/v1/models', '/v1/completions', '/v1/chat/completions', '/v1/agents', '/v1/agents/:agentId/events', '/admin/instances', '/topology', '/leases', '/fault_tolerance/event']) {
    t.ok(urls.has(u), `route table has ${u}`)
  }
  const guarded = routes.filter((r) => !PUBLIC.has(r.url))

  let tried = 0
  for (const route of guarded) {
    const plane = planeOf(route.url)
    const path = concretePath(route.url)
    const others = (Object.keys(CREDENTIAL) as Plane[]).filter((p) => p !== plane)
    const attempts = [
      ...targetVariants(path, origin).map((v) => ({ ...v, headers: {} as Record<string, string> })),
      ...others.map((p) => ({ label: `the ${p} credential`, target: path, headers: { authorization: `Bearer ${CREDENTIAL[p]}` } })),
      ...others.map((p) => ({ label: `the ${p} credential, absolute-form`, target: `${origin}${path}`, headers: { authorization: `Bearer ${CREDENTIAL[p]}` } })),
      { label: 'wrong token', target: path, headers: { authorization: 'Bearer wrong-wrong-wrong' } },
      { label: 'as x-api-key', target: path, headers: { 'x-api-key': CREDENTIAL[plane] } },
    ]
    for (const a of attempts) {
      const res = await rawRequest(port, route.method, a.target, a.headers)
      tried++
      const code = errorCode(res.body)
      const head = route.method === 'HEAD'
      const refused = (res.status === 401 && (head || code === REFUSAL[plane])) || (res.status === 404 && (head || code === 'RTR_ERR_ROUTE_NOT_FOUND'))
      if (!refused) t.fail(`${route.method} ${a.target} (${a.label}) answered ${res.status} ${res.body.slice(0, 160)}`)
    }
  }
  t.ok(tried > 200, `${tried} requests tried`)
  // No handler ran: nothing was registered, drained, removed or logged.
  t.equal(JSON.stringify(app.topology.snapshot().instances.map((i) => [i.id, i.draining])), before, 'topology untouched')
  t.same(app.events.agents.all(), [], 'no agent registered')
  t.equal(await app.events.store.last(), 0, 'nothing logged')

  // Its own credential gets every route past the check (the paths above are real routes).
  for (const route of guarded.filter((r) => r.method !== 'HEAD')) {
    const res = await rawRequest(port, route.method, concretePath(route.url), { authorization: `Bearer ${CREDENTIAL[planeOf(route.url)]}` })
    t.not(res.status, 401, `${route.method} ${route.url} with its credential passes the check (${res.status} ${res.body.slice(0, 80)})`)
    t.not(errorCode(res.body), 'RTR_ERR_ROUTE_NOT_FOUND', `${route.method} ${route.url} is routed`)
  }
  for (const p of PUBLIC) t.not((await rawRequest(port, 'GET', p)).status, 401, `${p} is public`)
})
