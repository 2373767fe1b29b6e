import { createServer, type IncomingHttpHeaders } from 'node:http'
import type { AddressInfo } from 'node:net'
import t, { type Test } from 'tap'
import type { LeaseGranted, PullDone } from '../../schemas/agent-api.js'
import { fillBlock, region, sameBytes, skipWithoutNixl, startAgent, type Agent, type Layout } from './agent-procs.js'

/*
 * Issue 18 §2: the agent↔agent handshake. An agent used to send its agent token as a bearer
 * to whatever remote_host:remote_port a pull named, and the same token opened the router's
 * agent routes and every agent's engine API. Now the peer plane has a credential of its own
 * (--peer-secret) that never goes on the wire: each handshake request carries a proof bound
 * to the address dialled, the time and a nonce, and each answer a proof over its body, so
 * whoever answers at a wrong address learns nothing it can use elsewhere and cannot pose as
 * a prefiller. Real agent processes and a hostile HTTP server of the test's; runs dist/.
 */

const skip = await skipWithoutNixl(t)
const layout: Layout = { blockSize: 16, bytesPerToken: 32, numBlocks: 32 }
const TOKEN = 'agent-token-peer-auth'
const SECRET = 'peer-secret-peer-auth'
const auth = { authorization: `Bearer ${TOKEN}` }

interface Seen {
  url: string
  headers: IncomingHttpHeaders
}

/** An HTTP server that records what it is sent and answers with a plausible handshake. */
async function impostor(t: Test, answer: () => unknown): Promise<{ port: number; seen: Seen[] }> {
  const seen: Seen[] = []
  const server = createServer((req, res) => {
    seen.push({ url: req.url ?? '', headers: req.headers })
    res.writeHead(200, { 'content-type': 'application/json' })
    res.end(JSON.stringify(answer()))
  })
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve))
  t.teardown(() => new Promise<void>((resolve) => server.close(() => resolve())))
  return { port: (server.address() as AddressInfo).port, seen }
}

t.test('the peer plane has its own credential, and it never leaves the agent', { skip }, async (t) => {
  const args = ['--lease-seconds', '5', '--agent-token', TOKEN, '--peer-secret', SECRET]
  const [P, D, Dother] = await Promise.all([startAgent(t, args), startAgent(t, args), startAgent(t, ['--lease-seconds', '5', '--agent-token', TOKEN, '--peer-secret', 'another-peer-secret-x'])])
  const pr = region(t, 'pauth-p', layout)
  const dr = region(t, 'pauth-d', layout)
  const d2 = region(t, 'pauth-d2', layout)
  const attachWith = (a: Agent, engineId: string, role: 'prefill' | 'decode', r: typeof pr) =>
    a.call('POST', '/v1/engine/attach', { engineId, role, shmName: r.name, ...layout }, auth)
  const pEngine = `pauth-p-${process.pid}`
  const [pa] = await Promise.all([attachWith(P, pEngine, 'prefill', pr), attachWith(D, `pauth-d-${process.pid}`, 'decode', dr), attachWith(Dother, `pauth-d2-${process.pid}`, 'decode', d2)])
  const { peerHost, peerPort } = pa.body as { peerHost: string; peerPort: number }
  const pullBody = (over: Record<string, unknown>) => ({
    requestId: 'x',
    remoteEngineId: pEngine,
    remoteRequestId: 'r',
    remoteHost: peerHost,
    remotePort: peerPort,
    remoteBlockIds: [3],
    localBlockIds: [3],
    ...over,
  })
  const lease = async (requestId: string, blockIds: number[]) => {
    const l = await P.call<LeaseGranted>('POST', '/v1/leases', { requestId, blockIds }, auth)
    t.equal(l.status, 201)
    return l.body.expiresAt
  }

  await t.test('two agents with the same peer secret pull as before', async (t) => {
    fillBlock(pr, 3, 9)
    const pull = await D.call<PullDone>('POST', '/v1/pulls', pullBody({ requestId: 'ok', remoteRequestId: 'ok', remoteBlocksExpiryTime: await lease('ok', [3]) }), auth)
    t.equal(pull.status, 200, JSON.stringify(pull.body))
    t.ok(sameBytes(dr.block(3), pr.block(3)), 'D holds P’s bytes')
  })

  await t.test('a pull naming an impostor: no token on the wire, its proof is useless at the real P, its answer is refused', async (t) => {
    const real = await fetch(`http://${peerHost}:${peerPort}/v1/peer/handshake?engine_id=${pEngine}`, { headers: auth })
    t.equal(real.status, 401, 'the agent token alone does not open the peer plane')
    const evil = await impostor(t, () => ({ engineId: 'evil', agentId: 'evil', metadata: 'AAAA', clock: 1, probe: false, region: { addr: '1', len: 4096, blockBytes: 512, numBlocks: 8 } }))
    const pull = await D.call('POST', '/v1/pulls', pullBody({ requestId: 'evil', remoteEngineId: 'evil', remoteHost: '127.0.0.1', remotePort: evil.port, remoteBlocksExpiryTime: 1e12 }), auth)
    t.match(pull, { status: 502, body: { error: { code: 'XFA_ERR_HANDSHAKE_FAILED' } } }, 'an answer without the peer proof is refused')
    // Refused by the handshake itself, before its metadata reaches NIXL (unchecked, the same
    // answer fails only later, as metadata NIXL cannot load).
    const message = String((pull.body as { error?: { message?: string } }).error?.message)
    t.match(message, new RegExp(`evil at 127\\.0\\.0\\.1:${evil.port}`), 'the handshake refused the answer')
    t.notMatch(message, /refused evil's metadata/, 'no metadata was loaded')
    t.ok(evil.seen.length >= 1, `the impostor was dialled (${evil.seen.length})`)
    for (const s of evil.seen) {
      const wire = JSON.stringify(s)
      t.notOk(wire.includes(TOKEN), 'the agent token is not sent to a peer')
      t.notOk(wire.includes(SECRET), 'nor the peer secret')
    }
    // Whatever the impostor was sent, replayed at the real P it opens nothing.
    const replay = evil.seen[0] as Seen
    const again = await fetch(`http://${peerHost}:${peerPort}${replay.url}`, { headers: Object.fromEntries(Object.entries(replay.headers).filter(([k]) => k !== 'host' && k !== 'connection')) as Record<string, string> })
    t.equal(again.status, 401, 'a captured handshake request replayed at P is refused')
    t.notMatch(await again.text(), /metadata/, 'and P’s metadata does not leak')
  })

  await t.test('an agent with another peer secret cannot handshake', async (t) => {
    const pull = await Dother.call('POST', '/v1/pulls', pullBody({ requestId: 'other', remoteRequestId: 'other', remoteBlocksExpiryTime: await lease('other', [5]), remoteBlockIds: [5], localBlockIds: [5] }), auth)
    t.match(pull, { status: 502, body: { error: { code: 'XFA_ERR_HANDSHAKE_FAILED' } } })
  })

  await t.test('the peer secret is no bearer token for the engine API', async (t) => {
    const res = await D.call('GET', '/v1/status', undefined, { authorization: `Bearer ${SECRET}` })
    t.equal(res.status, 401)
  })

  await t.test('a remote host that is no host name or IP address is refused before anything is dialled', async (t) => {
    for (const host of ['evil.example:80/x?', 'user@host', 'a b', 'x'.repeat(64) + '.example', '-lead.example']) {
      const res = await D.call('POST', '/v1/pulls', pullBody({ requestId: `bad-${host.length}`, remoteHost: host, remoteBlocksExpiryTime: 1e12 }), auth)
      t.match(res, { status: 400, body: { error: { code: 'XFA_ERR_INVALID_ARG' } } }, JSON.stringify(host))
    }
  })
})
