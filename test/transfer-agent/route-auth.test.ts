import pino from 'pino'
import t from 'tap'
import type { AddressInfo } from 'node:net'
import { createAgentMetrics } from '../../transfer-agent/src/metrics.js'
import { PEER_AUTH_SCHEME, peerKey, proveHandshake } from '../../transfer-agent/src/peer-proof.js'
import type { TransferAgent } from '../../transfer-agent/src/agent.js'
import { concretePath, errorCode, rawRequest, routeRecorder, targetVariants } from '../helpers/route-auth.js'

/*
 * Issue 18 item 1: with an agent token set, no route of the agent's own table except the
 * public probes answers without its plane's credential (the agent token for the engine API,
 * a peer proof for the handshake), whatever form the request target takes (absolute-form,
 * percent-escapes, case, slashes, query). The agent behind the app is a spy: a guarded call
 * that reached a handler would show up in `calls`. A route added outside the guarded plugins
 * fails here, because every route the app registers is tried.
 */

const TOKEN = 'agent-secret-123'
const PUBLIC = new Set(['/health', '/metrics'])
const KEY = peerKey(TOKEN)
const SPY_ADDRESS = '127.0.0.1:7400'
let nonce = 0
/** The handshake's credential: a fresh proof for the spy's address, as a peer makes it. */
function peerProof(): { query: string; authorization: string } {
  const claim = { callee: 'p', address: SPY_ADDRESS, caller: 'test', ts: Date.now(), nonce: (++nonce).toString(16).padStart(32, '0') }
  return { query: `?engine_id=p&caller=test&ts=${claim.ts}&nonce=${claim.nonce}`, authorization: `${PEER_AUTH_SCHEME} ${proveHandshake(KEY, claim)}` }
}

/** Records every method call; answers something a handler would send back as 200. */
function spyAgent(calls: string[]): TransferAgent {
  const events = {
    poll: async () => {
      calls.push('events.poll')
      return []
    },
  }
  return new Proxy({} as TransferAgent, {
    get(_target, prop) {
      if (prop === 'then') return undefined
      if (prop === 'agentId') return 'agent-spy'
      if (prop === 'attachment') return undefined
      if (prop === 'peerAddress') return SPY_ADDRESS
      if (prop === 'events') return events
      return async () => {
        calls.push(String(prop))
        return { spied: String(prop) }
      }
    },
  })
}

t.test('every guarded agent route refuses a request without the token, in any target form', async (t) => {
  const recorder = routeRecorder()
  const { buildAgentApp } = await t.mockImport<typeof import('../../transfer-agent/src/app.js')>('../../transfer-agent/src/app.js', {
    fastify: recorder.module,
  })
  const calls: string[] = []
  const app = buildAgentApp({ agent: spyAgent(calls), metrics: createAgentMetrics(), logger: pino({ level: 'silent' }), agentToken: TOKEN, peerKey: KEY })
  await app.listen({ host: '127.0.0.1', port: 0 })
  t.teardown(() => app.close())
  const { port } = app.server.address() as AddressInfo
  const origin = `http://127.0.0.1:${port}`

  const guarded = recorder.routes.filter((r) => !PUBLIC.has(r.url))
  const urls = new Set(recorder.routes.map((r) => r.url))
  // The recorder saw the app's routes (a recorder that saw none would prove nothing).
  for (const u of ['/health', '/metrics', '/v1/status', '/v1/engine/attach', '/v1/leases', '/v1/pulls', '/v1/engine/events', '/v1/peer/handshake', '/v1/peers/gone']) {
    t.ok(urls.has(u), `route table has ${u}`)
  }
  t.ok(recorder.routes.every((r) => app.hasRoute({ method: r.method as 'GET', url: r.url })), 'every recorded route is in the router')

  let tried = 0
  for (const route of guarded) {
    const path = concretePath(route.url)
    const proof = peerProof()
    const peerPlane = route.url === '/v1/peer/handshake'
    const attempts = [
      ...targetVariants(path, origin).map((v) => ({ ...v, headers: {} as Record<string, string> })),
      { label: 'wrong token', target: path, headers: { authorization: 'Bearer wrong' } },
      // The other plane's credential: a peer proof on the engine API, the token on the handshake.
      peerPlane
        ? { label: 'the agent token on the peer plane', target: `${path}${proof.query}`, headers: { authorization: `Bearer ${TOKEN}` } }
        : { label: 'a peer proof on the engine API', target: `${path}${proof.query}`, headers: { authorization: proof.authorization } },
      { label: 'token without scheme', target: path, headers: { authorization: TOKEN } },
      { label: 'token in the query', target: `${path}?token=${TOKEN}`, headers: {} },
    ]
    for (const a of attempts) {
      const res = await rawRequest(port, route.method, a.target, a.headers)
      tried++
      const code = errorCode(res.body)
      // A HEAD answer has no body to carry the code.
      const head = route.method === 'HEAD'
      const refused = (res.status === 401 && (head || code === 'XFA_ERR_UNAUTHORIZED')) || (res.status === 404 && (head || code === 'XFA_ERR_NOT_FOUND'))
      if (!refused) t.fail(`${route.method} ${a.target} (${a.label}) answered ${res.status} ${res.body.slice(0, 120)}`)
      t.notMatch(res.body, /spied/, `${route.method} ${a.label}: no handler's answer`)
    }
  }
  t.ok(tried > 100, `${tried} requests tried`)
  t.same(calls, [], 'no guarded call reached the agent')

  // Each plane's credential lets its routes through to their handler (or schema): the paths above are real.
  for (const route of guarded.filter((r) => r.method !== 'HEAD')) {
    const proof = peerProof()
    const res =
      route.url === '/v1/peer/handshake'
        ? await rawRequest(port, route.method, `${concretePath(route.url)}${proof.query}`, { authorization: proof.authorization })
        : await rawRequest(port, route.method, concretePath(route.url), { authorization: `Bearer ${TOKEN}` })
    const code = errorCode(res.body)
    t.not(code, 'XFA_ERR_UNAUTHORIZED', `${route.method} ${route.url} with the token passes the check`)
    t.not(code, 'XFA_ERR_NOT_FOUND', `${route.method} ${route.url} with the token is routed`)
  }
  t.ok(calls.includes('status') && calls.includes('handshakeAnswer'), `with the token, handlers run (${calls.join(', ')})`)

  for (const p of PUBLIC) t.equal((await rawRequest(port, 'GET', p)).status, 200, `${p} is public`)
})
