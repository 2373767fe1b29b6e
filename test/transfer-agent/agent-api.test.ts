import { spawn } from 'node:child_process'
import { once } from 'node:events'
import t, { type Test } from 'tap'
import { cliEntry } from '../../common/paths.js'
import type { LeaseGranted, PullDone } from '../../schemas/agent-api.js'
import { PEER_AUTH_SCHEME, peerKey, proveHandshake } from '../../transfer-agent/src/peer-proof.js'
import { attach, fillBlock, region, sameBytes, skipWithoutNixl, startAgent, waitEvent, type Agent, type Layout, type Region } from './agent-procs.js'

// The agent's HTTP API with real agent processes; the test is both engines (attach, lease,
// pull, read the events and the bytes). Runs dist/: `npm run build` first.

const skip = await skipWithoutNixl(t)
const layout: Layout = { blockSize: 16, bytesPerToken: 32, numBlocks: 64 }
const LEASE_S = 2

interface Pair {
  P: Agent
  D: Agent
  pr: Region
  dr: Region
  peerHost: string
  peerPort: number
}

/** A P and a D agent, both attached; the test's engine ids carry the pid. */
async function pair(t: Test, tag: string, args: string[] = [], env: NodeJS.ProcessEnv = {}): Promise<Pair> {
  const [P, D] = await Promise.all([startAgent(t, ['--lease-seconds', String(LEASE_S), ...args], env), startAgent(t, ['--lease-seconds', String(LEASE_S), ...args], env)])
  const pr = region(t, `${tag}-p`, layout)
  const dr = region(t, `${tag}-d`, layout)
  const [pa] = await Promise.all([attach(P, `p-${tag}-${process.pid}`, 'prefill', pr, layout), attach(D, `d-${tag}-${process.pid}`, 'decode', dr, layout)])
  return { P, D, pr, dr, peerHost: pa.peerHost, peerPort: pa.peerPort }
}

const pullBody = (p: Pair, over: Record<string, unknown>) => ({
  requestId: 'd-r1',
  remoteEngineId: `p-main-${process.pid}`,
  remoteRequestId: 'r1',
  remoteHost: p.peerHost,
  remotePort: p.peerPort,
  remoteBlockIds: [3, 4],
  remoteBlocksExpiryTime: null,
  localBlockIds: [10, 11],
  ...over,
})

t.test('agent API with real processes', { skip }, async (t) => {
  // Every agent this test needs, started together: a pair, one with an agent token (also
  // never attached) and a second decoder with the unsafe test switch and --allow-no-expiry.
  const [p, A, D2] = await Promise.all([
    pair(t, 'main'),
    startAgent(t, ['--lease-seconds', String(LEASE_S), '--agent-token', 's3cret']),
    startAgent(t, ['--lease-seconds', String(LEASE_S), '--unsafe-skip-deadline-checks', '--allow-no-expiry'], { HANDOFF_ALLOW_UNSAFE: '1' }),
  ])
  const { P, D, pr, dr } = p

  await t.test('lease then pull: the bytes arrive and P ends the lease as read_done', async (t) => {
    fillBlock(pr, 3, 1)
    fillBlock(pr, 4, 2)
    const lease = await P.call<LeaseGranted>('POST', '/v1/leases', { requestId: 'r1', blockIds: [3, 4] })
    t.equal(lease.status, 201)
    t.equal(lease.body.leaseSeconds, LEASE_S)
    const pull = await D.call<PullDone>('POST', '/v1/pulls', pullBody(p, { remoteBlocksExpiryTime: lease.body.expiresAt }))
    t.equal(pull.status, 200, JSON.stringify(pull.body))
    t.equal(pull.body.bytes, 2 * pr.blockBytes)
    t.ok(sameBytes(dr.block(10), pr.block(3)) && sameBytes(dr.block(11), pr.block(4)), 'D holds P’s bytes')
    const ended = await waitEvent(P, (e) => e.type === 'lease_ended' && e.requestId === 'r1', 2_000)
    t.match(ended, { type: 'lease_ended', requestId: 'r1', blockIds: [3, 4], reason: 'read_done' })
    t.equal(await D.metric('handoff_agent_pulls_total', { outcome: 'ok' }), 1)
    t.equal(await P.metric('handoff_agent_leases_ended_total', { reason: 'read_done' }), 1)
    const { events } = await D.events(0)
    t.same(events.filter((e) => e.type === 'pull_quiesced'), [], 'a successful pull sends no pull_quiesced')
  })

  await t.test('a lease nobody reads expires after about the lease', async (t) => {
    const started = Date.now()
    const lease = await P.call<LeaseGranted>('POST', '/v1/leases', { requestId: 'r-exp', blockIds: [20] })
    t.equal(lease.status, 201)
    const ended = await waitEvent(P, (e) => e.type === 'lease_ended' && e.requestId === 'r-exp', LEASE_S * 1000 + 2_000)
    const ms = Date.now() - started
    t.match(ended, { reason: 'expired', blockIds: [20] })
    t.ok(ms >= LEASE_S * 1000 - 100 && ms < LEASE_S * 1000 + 1_800, `expired after ${ms} ms`)
    t.equal(await P.metric('handoff_agent_leases_ended_total', { reason: 'expired' }), 1)
    // A pull of it now is declined before the READ: the deadline has passed.
    const pull = await D.call('POST', '/v1/pulls', pullBody(p, { requestId: 'd-exp', remoteRequestId: 'r-exp', remoteBlockIds: [20], localBlockIds: [20], remoteBlocksExpiryTime: lease.body.expiresAt }))
    t.match(pull, { status: 410, body: { error: { code: 'XFA_ERR_KV_EXPIRED' }, invalidBlockIds: [20], tainted: false } })
    t.ok(await waitEvent(D, (e) => e.type === 'pull_quiesced' && e.requestId === 'd-exp', 1_000), 'pull_quiesced at once')
    t.equal(await D.metric('handoff_agent_kv_expired_total', { check: 'before_read' }), 1)
  })

  await t.test('DELETE /v1/leases/:id ends the lease as released', async (t) => {
    t.equal((await P.call('POST', '/v1/leases', { requestId: 'r-del', blockIds: [30, 31] })).status, 201)
    t.same((await P.call('DELETE', '/v1/leases/r-del')).body, { released: true })
    t.match(await waitEvent(P, (e) => e.type === 'lease_ended' && e.requestId === 'r-del', 1_000), { reason: 'released', blockIds: [30, 31] })
    t.same((await P.call('DELETE', '/v1/leases/r-del')).body, { released: false }, 'a second DELETE is a no-op')
    t.equal((await P.call('POST', '/v1/leases', { requestId: 'r-del2', blockIds: [30] })).status, 201, 'the blocks can be leased again')
    await P.call('DELETE', '/v1/leases/r-del2')
  })

  await t.test('bad input is a coded 4xx', async (t) => {
    const expect = async (what: string, r: Promise<{ status: number; body: unknown }>, status: number, code: string) => {
      const res = await r
      t.match(res, { status, body: { error: { code } } }, what)
    }
    await expect('unknown route', D.call('GET', '/v1/nope'), 404, 'XFA_ERR_NOT_FOUND')
    await expect('unknown method', D.call('PUT', '/v1/leases'), 404, 'XFA_ERR_NOT_FOUND')
    await expect('empty request id', P.call('POST', '/v1/leases', { requestId: '', blockIds: [1] }), 400, 'XFA_ERR_INVALID_ARG')
    await expect('no blocks', P.call('POST', '/v1/leases', { requestId: 'x', blockIds: [] }), 400, 'XFA_ERR_INVALID_ARG')
    await expect('an unknown field', P.call('POST', '/v1/leases', { requestId: 'x', blockIds: [1], extra: 1 }), 400, 'XFA_ERR_INVALID_ARG')
    await expect('a string block id', P.call('POST', '/v1/leases', { requestId: 'x', blockIds: ['1'] }), 400, 'XFA_ERR_INVALID_ARG')
    await expect('pull missing fields', D.call('POST', '/v1/pulls', { requestId: 'x' }), 400, 'XFA_ERR_INVALID_ARG')
    await expect('events query not digits', D.call('GET', '/v1/engine/events?after=-1'), 400, 'XFA_ERR_INVALID_ARG')
    await expect('attach with a bad shm name', D.call('POST', '/v1/engine/attach', { engineId: 'e', role: 'decode', shmName: 'no-slash', ...layout }), 400, 'XFA_ERR_INVALID_ARG')
    await expect('lease block out of range', P.call('POST', '/v1/leases', { requestId: 'x', blockIds: [1, layout.numBlocks] }), 400, 'XFA_ERR_INVALID_ARG')
    await expect('lease block twice', P.call('POST', '/v1/leases', { requestId: 'x', blockIds: [1, 1] }), 400, 'XFA_ERR_INVALID_ARG')
    const oob = await D.call('POST', '/v1/pulls', pullBody(p, { requestId: 'd-oob', localBlockIds: [10, layout.numBlocks] }))
    t.match(oob, { status: 400, body: { error: { code: 'XFA_ERR_INVALID_ARG' }, invalidBlockIds: [10, layout.numBlocks], tainted: false } }, 'pull block out of range')
    // No lease expiry (vLLM's own P exports null): nothing says P still holds the blocks (issue 18).
    const noExpiry = await D.call('POST', '/v1/pulls', pullBody(p, { requestId: 'd-noexp' }))
    t.match(noExpiry, { status: 400, body: { error: { code: 'XFA_ERR_NO_LEASE_EXPIRY' }, invalidBlockIds: [10, 11], tainted: false } }, 'pull without an expiry')
    t.ok(await waitEvent(D, (e) => e.type === 'pull_quiesced' && e.requestId === 'd-noexp', 1_000), 'pull_quiesced for the refused pull')
    t.equal(await D.metric('handoff_agent_pulls_without_expiry_total'), 0)

    t.equal((await P.call('POST', '/v1/leases', { requestId: 'r-a', blockIds: [40, 41] })).status, 201)
    await expect('blocks already leased', P.call('POST', '/v1/leases', { requestId: 'r-b', blockIds: [41, 42] }), 409, 'XFA_ERR_BLOCKS_LEASED')
    await expect('lease id reused', P.call('POST', '/v1/leases', { requestId: 'r-a', blockIds: [50] }), 409, 'XFA_ERR_LEASE_EXISTS')
    t.equal((await P.call('POST', '/v1/leases', { requestId: 'r-b', blockIds: [42] })).status, 201, 'a refused lease holds nothing')
    await P.call('DELETE', '/v1/leases/r-a')
    await P.call('DELETE', '/v1/leases/r-b')
  })

  await t.test('before attach: 409 XFA_ERR_NOT_ATTACHED', async (t) => {
    const auth = { authorization: 'Bearer s3cret' }
    t.match(await A.call('POST', '/v1/leases', { requestId: 'x', blockIds: [1] }, auth), { status: 409, body: { error: { code: 'XFA_ERR_NOT_ATTACHED' } } })
    t.match(await A.call('POST', '/v1/pulls', pullBody(p, {}), auth), { status: 409, body: { error: { code: 'XFA_ERR_NOT_ATTACHED' }, invalidBlockIds: [10, 11] } })
    t.match(await A.call('GET', '/v1/peer/handshake', undefined, auth), { status: 401, body: { error: { code: 'XFA_ERR_UNAUTHORIZED' } } }, 'the token is no credential for the peer plane')
    // A peer's proof (the key is the agent token: A has no peer secret) gets through.
    const claim = { callee: 'p', address: `127.0.0.1:${A.port}`, caller: 'test', ts: Date.now(), nonce: '0f'.repeat(16) }
    const proved = await A.call('GET', `/v1/peer/handshake?engine_id=p&caller=test&ts=${claim.ts}&nonce=${claim.nonce}`, undefined, { authorization: `${PEER_AUTH_SCHEME} ${proveHandshake(peerKey('s3cret'), claim)}` })
    t.match(proved, { status: 409, body: { error: { code: 'XFA_ERR_NOT_ATTACHED' } } })
    t.match(await A.call('DELETE', '/v1/leases/x', undefined, auth), { status: 409, body: { error: { code: 'XFA_ERR_NOT_ATTACHED' } } })
    t.match(await A.call('GET', '/health'), { status: 200, body: { status: 'ok', attached: false } })
  })

  await t.test('a second pull of a request in flight: 409 XFA_ERR_PULL_EXISTS', async (t) => {
    // D2 has not handshaken with P yet, so its first pull hangs in the handshake while P is
    // stopped. It also runs with the unsafe test switch (checked below).
    const d2r = region(t, 'd2', layout)
    await attach(D2, `d2-${process.pid}`, 'decode', d2r, layout)
    fillBlock(pr, 5, 9)
    const lease = await P.call<LeaseGranted>('POST', '/v1/leases', { requestId: 'r-dup', blockIds: [5] })
    t.equal(lease.status, 201)
    const body = pullBody(p, { requestId: 'd-dup', remoteRequestId: 'r-dup', remoteBlockIds: [5], localBlockIds: [5], remoteBlocksExpiryTime: lease.body.expiresAt })
    P.svc.child.kill('SIGSTOP')
    let first: Promise<{ status: number; body: unknown }>
    try {
      first = D2.call('POST', '/v1/pulls', body)
      // Once the first pull is in flight (hanging in the handshake), the same request again.
      const until = Date.now() + 5_000
      while ((await D2.call<{ pullsInFlight: number }>('GET', '/v1/status')).body.pullsInFlight < 1 && Date.now() < until) {
        await new Promise((r) => setTimeout(r, 10))
      }
      const dup = await D2.call('POST', '/v1/pulls', { ...body, localBlockIds: [6] })
      t.match(dup, { status: 409, body: { error: { code: 'XFA_ERR_PULL_EXISTS' }, invalidBlockIds: [6], tainted: false } })
    } finally {
      P.svc.child.kill('SIGCONT')
    }
    const r = await first
    t.equal(r.status, 200, `the first pull completes once P runs again: ${JSON.stringify(r.body)}`)
    t.ok(sameBytes(d2r.block(5), pr.block(5)))

    // The test switch: a lease that ended long ago is read anyway (both checks off).
    const stale = await D2.call('POST', '/v1/pulls', pullBody(p, { requestId: 'd-stale', remoteRequestId: 'r-stale', remoteBlockIds: [5], localBlockIds: [7], remoteBlocksExpiryTime: lease.body.expiresAt - 600 }))
    t.equal(stale.status, 200, 'stale read let through by --unsafe-skip-deadline-checks')

    // --allow-no-expiry: a pull naming no expiry is read, unchecked, and counted.
    const unchecked = await D2.call('POST', '/v1/pulls', pullBody(p, { requestId: 'd-noexp2', remoteRequestId: 'r-noexp2', remoteBlockIds: [5], localBlockIds: [8] }))
    t.equal(unchecked.status, 200, JSON.stringify(unchecked.body))
    t.equal(await D2.metric('handoff_agent_pulls_without_expiry_total'), 1)
  })

  await t.test('--unsafe-skip-deadline-checks without HANDOFF_ALLOW_UNSAFE=1 exits 2', async (t) => {
    const env = { ...process.env }
    delete env.HANDOFF_ALLOW_UNSAFE
    const child = spawn(process.execPath, [cliEntry, 'agent', '--port', '0', '--unsafe-skip-deadline-checks'], { env, stdio: ['ignore', 'pipe', 'pipe'] })
    let stderr = ''
    child.stderr.on('data', (c: Buffer) => (stderr += c.toString()))
    const timer = setTimeout(() => child.kill('SIGKILL'), 15_000)
    const [code] = (await once(child, 'exit')) as [number | null]
    clearTimeout(timer)
    t.equal(code, 2)
    t.match(stderr, /XFA_ERR_INVALID_ARG/)
    t.match(stderr, /--unsafe-skip-deadline-checks is a test switch: it needs HANDOFF_ALLOW_UNSAFE=1/)
  })

  await t.test('--agent-token: /v1/ needs the bearer token, /health does not', async (t) => {
    t.match(await A.call('GET', '/v1/status'), { status: 401, body: { error: { code: 'XFA_ERR_UNAUTHORIZED' } } })
    t.match(await A.call('GET', '/v1/status', undefined, { authorization: 'Bearer wrong' }), { status: 401, body: { error: { code: 'XFA_ERR_UNAUTHORIZED' } } })
    t.match(await A.call('POST', '/v1/leases', { requestId: 'x', blockIds: [1] }), { status: 401, body: { error: { code: 'XFA_ERR_UNAUTHORIZED' } } })
    t.match(await A.call('GET', '/v1/status', undefined, { authorization: 'Bearer s3cret' }), { status: 200 })
    t.match(await A.call('GET', '/health'), { status: 200 })
  })
})

t.test('heartbeats reach P during a slow READ (tcp, 32 MiB)', { skip }, async (t) => {
  // Over tcp the READ takes long enough for a few heartbeats every 5 ms.
  const big: Layout = { blockSize: 16, bytesPerToken: 65536, numBlocks: 32 }
  const env = { UCX_TLS: 'tcp' }
  const [P, D] = await Promise.all([startAgent(t, ['--lease-seconds', '5'], env), startAgent(t, ['--lease-seconds', '5', '--heartbeat-ms', '5'], env)])
  const pr = region(t, 'hb-p', big)
  const dr = region(t, 'hb-d', big)
  const [pa] = await Promise.all([attach(P, `p-hb-${process.pid}`, 'prefill', pr, big), attach(D, `d-hb-${process.pid}`, 'decode', dr, big)])
  const ids = [...Array(big.numBlocks).keys()]
  for (const i of ids) fillBlock(pr, i, i + 100)
  const lease = await P.call<LeaseGranted>('POST', '/v1/leases', { requestId: 'r-hb', blockIds: ids })
  const pull = await D.call<PullDone>('POST', '/v1/pulls', {
    requestId: 'd-hb',
    remoteEngineId: `p-hb-${process.pid}`,
    remoteRequestId: 'r-hb',
    remoteHost: pa.peerHost,
    remotePort: pa.peerPort,
    remoteBlockIds: ids,
    remoteBlocksExpiryTime: lease.body.expiresAt,
    localBlockIds: ids,
  })
  t.equal(pull.status, 200, JSON.stringify(pull.body))
  t.ok(ids.every((i) => sameBytes(dr.block(i), pr.block(i))), 'all 32 MiB arrived')
  // D counts a heartbeat when its send returns: `ok`, or `failed` when the send took longer
  // than the deadline proof allows (a loaded machine), though the notification left anyway;
  // one in flight as the READ ended is counted a moment after the pull answered.
  const sentBy = async (outcome: 'ok' | 'failed'): Promise<number> => D.metric('handoff_agent_heartbeats_total', { outcome })
  const sent = await sentBy('ok')
  if (sent === 0) {
    t.comment('the READ finished before the first heartbeat was due: nothing to check')
    return
  }
  // Notifications are asynchronous: every heartbeat sent reaches P, a little later. One that
  // lands after the READ's read-done notification finds the lease ended ("unknown"), which is
  // the protocol's own race (no acknowledgement), not a lost heartbeat.
  const reached = async (): Promise<{ extended: number; unknown: number }> => ({
    extended: await P.metric('handoff_agent_heartbeats_received_total', { result: 'extended' }),
    unknown: await P.metric('handoff_agent_heartbeats_received_total', { result: 'unknown' }),
  })
  let got = await reached()
  for (let i = 0; i < 60 && got.extended + got.unknown < sent; i++) {
    await new Promise((resolve) => setTimeout(resolve, 50))
    got = await reached()
  }
  const left = (await sentBy('ok')) + (await sentBy('failed'))
  t.comment(`READ ${Math.round(pull.body.readMicros / 1000)} ms; heartbeats sent ${sent} ok (${left} left D in all), on P: ${got.extended} extended the lease, ${got.unknown} came after it ended`)
  t.ok(got.extended + got.unknown >= sent, 'every heartbeat sent reached P')
  t.ok(got.extended + got.unknown <= left, 'and P heard none that D did not send')
  t.ok(got.extended <= left, 'never more extensions than heartbeats sent')
})
