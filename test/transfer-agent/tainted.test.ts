import t from 'tap'
import type { LeaseGranted } from '../../schemas/agent-api.js'
import { attach, fillBlock, region, skipWithoutNixl, startAgent, waitEvent, type Layout } from './agent-procs.js'

// DESIGN "Transfer agent" → Aborts are not instant: a pull that failed leaves its
// destination blocks tainted until the native gate proves the READ quiescent, and the engine
// gets them back (pull_quiesced) only then. Here the prefiller's agent is frozen mid-READ over
// tcp (so P's process must serve the READ; over CMA it would not need to), the decoder's READ
// times out, the pull fails tainted, and no block the engine reuses after pull_quiesced
// changes afterwards. Runs dist/: `npm run build` first.

const skip = await skipWithoutNixl(t)

// 64 × 1 MiB: one READ takes a few hundred ms over tcp on loopback.
const big: Layout = { blockSize: 16, bytesPerToken: 65536, numBlocks: 64 }
const READ_TIMEOUT_MS = 200
// The native gate waits this long (its quiesceMs default) for NIXL to finish an aborted READ
// before it answers tainted.
const QUIESCE_MS = 5_000

const sleep = (ms: number): Promise<void> => new Promise((r) => setTimeout(r, ms))

t.test('a READ frozen over tcp: tainted until quiescent, and reused blocks never change', { skip }, async (t) => {
  const env = { UCX_TLS: 'tcp' }
  const [P, D] = await Promise.all([startAgent(t, [], env), startAgent(t, ['--read-timeout-ms', String(READ_TIMEOUT_MS)], env)])
  const pr = region(t, 'taint-p', big)
  const dr = region(t, 'taint-d', big)
  const pEngine = `p-taint-${process.pid}`
  const [pa] = await Promise.all([attach(P, pEngine, 'prefill', pr, big), attach(D, `d-taint-${process.pid}`, 'decode', dr, big)])
  const ids = [...Array(big.numBlocks).keys()]
  for (const i of ids) fillBlock(pr, i, 1)
  // (startAgent's teardown continues a frozen P before stopping it.)
  const pull = (requestId: string, remoteRequestId: string, blocks: number[], expiresAt: number) =>
    D.call<{ error?: { code: string; message: string }; invalidBlockIds?: number[]; tainted?: boolean }>('POST', '/v1/pulls', {
      requestId,
      remoteEngineId: pEngine,
      remoteRequestId,
      remoteHost: pa.peerHost,
      remotePort: pa.peerPort,
      remoteBlockIds: blocks,
      remoteBlocksExpiryTime: expiresAt,
      localBlockIds: blocks,
    })
  const lease = async (requestId: string, blocks: number[]) => {
    const r = await P.call<LeaseGranted>('POST', '/v1/leases', { requestId, blockIds: blocks })
    if (r.status !== 201) throw new Error(`lease ${requestId}: ${r.status} ${JSON.stringify(r.body)}`)
    return r.body.expiresAt
  }

  // Warm up: the handshake is cached, so the pulls below talk to P only through the READ.
  const warm = await pull('d-warm', 'r-warm', [0], await lease('r-warm', [0]))
  t.equal(warm.status, 200, JSON.stringify(warm.body))
  for (const i of ids) dr.block(i).fill(0)

  // Freeze P a moment after the pull starts (mid-READ); if the READ beat the signal, once more
  // with P frozen before the pull is sent (the READ then stalls from its first byte).
  let res: Awaited<ReturnType<typeof pull>> | undefined
  let stoppedAt = 0
  for (const stopFirst of [false, true]) {
    const expiresAt = await lease(`r-big-${stopFirst}`, ids)
    if (stopFirst) {
      P.svc.child.kill('SIGSTOP')
      stoppedAt = Date.now()
    }
    const pending = pull(`d-big-${stopFirst}`, `r-big-${stopFirst}`, ids, expiresAt)
    if (!stopFirst) {
      await sleep(10)
      P.svc.child.kill('SIGSTOP')
      stoppedAt = Date.now()
    }
    res = await pending
    if (res.status !== 200) break
    t.comment(`the READ finished before P was frozen (stopFirst=${stopFirst}); again`)
    P.svc.child.kill('SIGCONT')
    for (const i of ids) dr.block(i).fill(0)
  }
  const answeredMs = Date.now() - stoppedAt
  t.match(res, { status: 502, body: { error: { code: 'XFA_ERR_READ_FAILED' }, invalidBlockIds: ids, tainted: true } }, 'the pull fails tainted')
  t.comment(`answered ${answeredMs} ms after P was frozen (read timeout ${READ_TIMEOUT_MS} ms + quiesce wait ${QUIESCE_MS} ms)`)

  const status = (await D.call<{ pullsInFlight: number; taintedBlocks: number }>('GET', '/v1/status')).body
  t.equal(status.pullsInFlight, 0, 'the pull is over')
  t.equal(status.taintedBlocks, big.numBlocks, 'status counts the blocks as tainted')
  t.equal(await D.metric('handoff_agent_tainted_blocks'), big.numBlocks, 'and so does the gauge')

  // While P stays frozen the blocks must not be handed back.
  const early = await waitEvent(D, (e) => e.type === 'pull_quiesced' && e.requestId.startsWith('d-big-'), 1_000)
  t.equal(early, undefined, 'no pull_quiesced while P is frozen: the engine may not reuse the blocks')

  const landedBefore = countEqual(dr.bytes, pr.bytes)
  P.svc.child.kill('SIGCONT')
  const quiesced = await waitEvent(D, (e) => e.type === 'pull_quiesced' && e.requestId.startsWith('d-big-'), 15_000)
  t.match(quiesced, { type: 'pull_quiesced', blockIds: ids }, 'pull_quiesced once P runs and the READ is done')
  const landedAfter = countEqual(dr.bytes, pr.bytes)
  t.comment(`bytes of P's data in D's blocks: ${landedBefore} when the pull failed, ${landedAfter} at pull_quiesced (of ${dr.bytes.length})`)
  t.equal((await D.call<{ taintedBlocks: number }>('GET', '/v1/status')).body.taintedBlocks, 0, 'nothing tainted any more')

  // The engine reuses the blocks now: another request's bytes go in, and nothing may change them.
  const pattern = new Uint8Array(dr.bytes.length)
  for (let k = 0; k < pattern.length; k++) pattern[k] = (k * 13 + 5) & 0xff
  dr.bytes.set(pattern)
  const until = Date.now() + 2_000
  let changed = 0
  while (Date.now() < until && changed === 0) {
    await sleep(50)
    changed = dr.bytes.length - countEqual(dr.bytes, pattern)
  }
  t.comment(`bytes changed after reuse: ${changed}`)
  t.equal(changed, 0, 'no byte of a reused block changed')

  // The agent still works: a pull after all this succeeds (same cached handshake).
  const after = await pull('d-after', 'r-after', [1, 2], await lease('r-after', [1, 2]))
  t.equal(after.status, 200, JSON.stringify(after.body))
})

/** How many positions hold the same byte in `a` and `b` (same length). */
function countEqual(a: Uint8Array, b: Uint8Array): number {
  let n = 0
  for (let i = 0; i < a.length; i++) if (a[i] === b[i]) n++
  return n
}
