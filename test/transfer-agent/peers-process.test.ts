import t from 'tap'
import type { LeaseGranted } from '../../schemas/agent-api.js'
import { attach, fillBlock, region, sameBytes, skipWithoutNixl, startAgent, type Agent, type Layout } from './agent-procs.js'

// Peer cleanup (DESIGN "Transfer agent" → Peer cleanup) with real agent processes: a
// prefiller's agent restarted under a new engine_id and under the same one, and the router's
// peer_gone. The test is both engines. Runs dist/: `npm run build` first.

const skip = await skipWithoutNixl(t)
const layout: Layout = { blockSize: 16, bytesPerToken: 32, numBlocks: 32 }

t.test('peers: a restarted prefiller, a new engine_id, the same one, and peer_gone', { skip }, async (top) => {
  const t = top
  // A READ on a dead link must not hang the test: 3 s, then the gate's quiesce wait.
  const D = await startAgent(t, ['--read-timeout-ms', '3000'])
  const pr = region(t, 'peers-p', layout)
  const dr = region(t, 'peers-d', layout)
  await attach(D, `d-peers-${process.pid}`, 'decode', dr, layout)
  let P = await startAgent(t)
  const port = P.port
  const engineA = `p-a-${process.pid}`
  const engineB = `p-b-${process.pid}`
  let seq = 0

  /** Leases `block` on P, then pulls it naming `engine`; the reply and how long it took. */
  const leaseAndPull = async (P: Agent, engine: string, block: number) => {
    const id = `r${++seq}`
    fillBlock(pr, block, seq)
    const lease = await P.call<LeaseGranted>('POST', '/v1/leases', { requestId: id, blockIds: [block] })
    if (lease.status !== 201) throw new Error(`lease: ${lease.status} ${JSON.stringify(lease.body)}`)
    const started = Date.now()
    const res = await D.call<{ error?: { code: string } }>('POST', '/v1/pulls', {
      requestId: `d-${id}`,
      remoteEngineId: engine,
      remoteRequestId: id,
      remoteHost: '127.0.0.1',
      remotePort: port,
      remoteBlockIds: [block],
      remoteBlocksExpiryTime: lease.body.expiresAt,
      localBlockIds: [block],
    })
    await P.call('DELETE', `/v1/leases/${id}`)
    return { ...res, ms: Date.now() - started, same: sameBytes(dr.block(block), pr.block(block)) }
  }
  const releases = (reason: string) => D.metric('handoff_agent_peer_releases_total', { reason })
  const handshakes = () => D.metric('handoff_agent_handshakes_total', { outcome: 'ok' })

  await attach(P, engineA, 'prefill', pr, layout)
  const first = await leaseAndPull(P, engineA, 1)
  t.equal(first.status, 200, JSON.stringify(first.body))
  t.ok(first.same)

  await t.test('P restarted at the same port under a new engine_id: D handshakes with it and releases the old one', async (t) => {
    const stopping = Date.now()
    t.comment(`P stopped: ${String(await P.stop())} in ${Date.now() - stopping} ms`)
    // Owned by the outer test: the next subtest uses it too.
    P = await startAgent(top, ['--port', String(port)])
    t.equal(P.port, port)
    await attach(P, engineB, 'prefill', pr, layout)
    const r = await leaseAndPull(P, engineB, 2)
    t.equal(r.status, 200, JSON.stringify(r.body))
    t.ok(r.same, 'the bytes come from the new agent')
    t.equal(await handshakes(), 2)
    t.equal(await releases('engine_id_changed'), 1, 'the old engine_id released without waiting for the router')
    // The old engine_id answered at that address before: late pulls naming it fail fast.
    const late = await leaseAndPull(P, engineA, 3)
    t.match(late, { status: 410, body: { error: { code: 'XFA_ERR_PEER_GONE' } } })
  })

  await t.test('P restarted with the same engine_id: at most one pull fails on the dead link, the next re-handshakes', async (t) => {
    const stopping = Date.now()
    t.comment(`P stopped: ${String(await P.stop())} in ${Date.now() - stopping} ms`)
    // Owned by the outer test: the next subtest uses it too.
    P = await startAgent(top, ['--port', String(port)])
    await attach(P, engineB, 'prefill', pr, layout)
    const before = await handshakes()
    const r1 = await leaseAndPull(P, engineB, 4)
    t.comment(`first pull after the restart: ${r1.status} ${r1.status === 200 ? '' : JSON.stringify(r1.body)} in ${r1.ms} ms`)
    if (r1.status === 200) {
      t.ok(r1.same, 'a first pull that succeeded read the right bytes')
    } else {
      t.equal(r1.status, 502)
      t.ok(['XFA_ERR_PEER_DISCONNECTED', 'XFA_ERR_READ_FAILED'].includes(r1.body.error?.code ?? ''), `failed as a disconnect: ${r1.body.error?.code}`)
    }
    const r2 = await leaseAndPull(P, engineB, 5)
    t.equal(r2.status, 200, `the pull after it succeeds: ${JSON.stringify(r2.body)}`)
    t.ok(r2.same)
    t.equal(await handshakes(), before + 1, 'exactly one new handshake')
    if (r1.status !== 200) t.equal(await releases('disconnect'), 1, 'the dead generation released as a disconnect')
  })

  await t.test('peer_gone: pulls naming the engine fail fast; repeats and unknown engines are no-ops', async (t) => {
    const handshakesBefore = await handshakes()
    const gone = await D.call('POST', '/v1/peers/gone', { engineIds: [engineB], reason: 'test' })
    t.match(gone, { status: 200, body: { applied: true } })
    t.equal(await releases('peer_gone'), 1)
    const r = await leaseAndPull(P, engineB, 6)
    t.match(r, { status: 410, body: { error: { code: 'XFA_ERR_PEER_GONE' }, invalidBlockIds: [6], tainted: false } })
    t.ok(r.ms < 1_000, `failed fast (${r.ms} ms)`)
    t.match(await D.call('POST', '/v1/peers/gone', { engineIds: [engineB] }), { status: 200 }, 'again: a no-op')
    t.match(await D.call('POST', '/v1/peers/gone', { engineIds: ['nobody'], addresses: ['10.9.9.9:1'] }), { status: 200 }, 'unknown: a no-op')
    t.equal(await releases('peer_gone'), 1, 'released once')
    t.equal(await handshakes(), handshakesBefore, 'no handshake attempted')
    t.match(await D.call('POST', '/v1/peers/gone', { engineIds: [''] }), { status: 400, body: { error: { code: 'XFA_ERR_INVALID_ARG' } } })
  })
})
