import t, { type Test } from 'tap'
import { ManualClock } from '../../common/clock.js'
import { deferred, type Deferred } from '../../common/deferred.js'
import type { PreparedBlocks } from '../../native/index.js'
import type { PullDone, PullRequest } from '../../schemas/agent-api.js'
import type { ClockSample } from '../../transfer-agent/src/deadline.js'
import { HeartbeatRegistry } from '../../transfer-agent/src/heartbeats.js'
import { PeerTable, type HandshakeResult, type PeerRelease } from '../../transfer-agent/src/peers.js'
import { Puller, type PullerOptions, type PullFailure, type PullReport, type PullTarget } from '../../transfer-agent/src/pulls.js'

// Puller with a ManualClock, the real HeartbeatRegistry and PeerTable, and fakes for the
// handshake, the gate and the NIXL side (readBlocks answers whatever the test says).

/** Lets every pending promise continuation run. */
const flush = (): Promise<void> => new Promise((resolve) => setImmediate(resolve))

/** A rejection as the native gate makes them: an Error with a NAT_ERR_* code (and extras). */
const natError = (code: string, extra: Record<string, unknown> = {}): Error => Object.assign(new Error(code), { code, ...extra })

const LEASE_MS = 6_000
const SAFETY_MS = 500
// Both clocks read the same; uncertainty 1 ms, so the margin is 501 ms (under lease/4).
const sample: ClockSample = { offsetMs: 0, uncertaintyMs: 1, rttMs: 2 }
const MARGIN = 501
const BLOCK_BYTES = 64
const NUM_BLOCKS = 16

const blocks = (engineId: string | null, count: number): PreparedBlocks => ({
  id: engineId === null ? 1 : 2,
  engineId,
  registration: null,
  base: 0n,
  devId: 0,
  kind: 'dram',
  blockBytes: BLOCK_BYTES,
  count,
})

interface ReadCall {
  engineId: string
  localIdx: readonly number[]
  remoteIdx: readonly number[]
  opts: { notif?: string; timeoutMs?: number; signal?: AbortSignal }
  d: Deferred<{ bytes: number; micros: number }>
}

function harness(t: Test, opts: Partial<PullerOptions> & { autoRead?: boolean } = {}) {
  const clock = new ManualClock({ monotonic: 100_000 })
  const heartbeats = new HeartbeatRegistry({ clock })
  let handshakes = 0
  // P's NIXL agent: the same metadata at every handshake until `restartPeer()`.
  let epoch = 1
  const releases: PeerRelease[] = []
  const forgets: string[] = []
  const peers = new PeerTable({
    clock,
    handshake: async (_address, expected) => {
      handshakes++
      const answer: HandshakeResult = {
        engineId: expected,
        metadata: Buffer.from(`md:${expected}:${epoch}`),
        clock: sample,
        region: { addr: 4096n, len: NUM_BLOCKS * BLOCK_BYTES, blockBytes: BLOCK_BYTES, numBlocks: NUM_BLOCKS },
      }
      return answer
    },
    gate: {
      loadPeer: async () => undefined,
      forgetPeer: async (engineId) => {
        forgets.push(engineId)
      },
    },
    onRelease: (r) => releases.push(r),
  })
  const reads: ReadCall[] = []
  let prepares = 0
  const target: PullTarget = {
    numBlocks: NUM_BLOCKS,
    blockBytes: BLOCK_BYTES,
    blocks: blocks(null, NUM_BLOCKS),
    nixl: {
      prepareRemoteBlocks: async (engineId, region, blockBytes) => {
        prepares++
        return blocks(engineId, region.len / blockBytes)
      },
      readBlocks: (engineId, _local, localIdx, _remote, remoteIdx, o) => {
        const d = deferred<{ bytes: number; micros: number }>()
        reads.push({ engineId, localIdx, remoteIdx, opts: o, d })
        if (opts.autoRead) d.resolve({ bytes: localIdx.length * BLOCK_BYTES, micros: 42 })
        return d.promise
      },
    },
  }
  const quiesced: { requestId: string; blockIds: readonly number[] }[] = []
  const gaveUp: string[] = []
  const reports: PullReport[] = []
  const { autoRead: _ignored, ...rest } = opts
  const puller = new Puller({
    clock,
    peers,
    heartbeats,
    target: () => target,
    leaseMs: LEASE_MS,
    safetyMs: SAFETY_MS,
    readTimeoutMs: 1_000,
    checkDeadlines: true,
    onQuiesced: (requestId, blockIds) => quiesced.push({ requestId, blockIds: [...blockIds] }),
    onGaveUp: (engineId, remoteRequestId) => gaveUp.push(`${engineId}/${remoteRequestId}`),
    onSettled: (r) => reports.push(r),
    ...rest,
  })
  /** A pull request for P's blocks `remote` into local `local`, P's lease `leaseLeftMs` from now. */
  const request = (over: Partial<PullRequest> & { leaseLeftMs?: number } = {}): PullRequest => {
    const { leaseLeftMs = LEASE_MS, ...r } = over
    return {
      requestId: 'd-1',
      remoteEngineId: 'p0',
      remoteRequestId: 'r-1',
      remoteHost: '127.0.0.1',
      remotePort: 7000,
      remoteBlockIds: [3, 4],
      remoteBlocksExpiryTime: (clock.monotonic() + leaseLeftMs) / 1000,
      localBlockIds: [10, 11],
      ...r,
    }
  }
  /** Starts a pull, with its outcome captured so the test can look before it settles. */
  const start = (req: PullRequest, signal = new AbortController().signal) => {
    const out: { done?: PullDone; failure?: PullFailure; settled: boolean } = { settled: false }
    const p = puller.pull(req, signal).then(
      (done) => Object.assign(out, { done, settled: true }),
      (failure: PullFailure) => Object.assign(out, { failure, settled: true }),
    )
    return Object.assign(out, { promise: p })
  }
  /** start, then lets the pull run up to its READ (or its end). */
  const started = async (req: PullRequest, signal?: AbortSignal) => {
    const p = start(req, signal)
    await flush()
    return p
  }
  /** Answers READ `i` (a result resolves it, an Error rejects it), then waits for `pull` to settle. */
  const finish = async (pull: { promise: Promise<unknown> }, outcome: { bytes: number; micros: number } | Error, i = 0): Promise<void> => {
    const read = reads[i]
    if (!read) throw new Error(`no READ #${i}`)
    if (outcome instanceof Error) read.d.reject(outcome)
    else read.d.resolve(outcome)
    await pull.promise
  }
  /** Nothing left behind: every heartbeat record and every in-flight pull is gone. */
  const clean = (): void => {
    t.equal(puller.inFlight, 0, 'no pull left in flight')
    t.equal(heartbeats.size, 0, 'no heartbeat record left')
  }
  return {
    clock,
    heartbeats,
    peers,
    puller,
    reads,
    quiesced,
    gaveUp,
    reports,
    releases,
    forgets,
    request,
    start,
    started,
    finish,
    clean,
    handshakes: () => handshakes,
    prepares: () => prepares,
    restartPeer: () => epoch++,
  }
}

t.test('a pull within the lease reads the blocks; the heartbeat record lives until the READ is done', async (t) => {
  const h = harness(t)
  const p = await h.started(h.request())
  t.equal(h.reads.length, 1, 'READ posted')
  const read = h.reads[0]
  t.same([read?.engineId, read?.localIdx, read?.remoteIdx], ['p0', [10, 11], [3, 4]])
  t.equal(read?.opts.notif, 'r-1:1', 'the read-done notification names P’s request')
  t.equal(read?.opts.timeoutMs, 1_000)
  t.ok(h.heartbeats.get('p0', 'r-1'), 'heartbeats are due while the READ is in flight')
  t.equal(h.puller.inFlight, 1)
  h.clock.advance(5)
  read?.d.resolve({ bytes: 128, micros: 900 })
  await p.promise
  t.match(p.done, { requestId: 'd-1', bytes: 128, readMicros: 900 })
  t.equal(h.heartbeats.get('p0', 'r-1'), undefined, 'record dropped after success')
  t.same(h.quiesced, [], 'a successful pull sends no pull_quiesced')
  t.match(h.reports, [{ outcome: 'ok', bytes: 128, readMicros: 900, tainted: false, beforeReadMs: 0, pullMs: 5 }])
  t.equal(h.handshakes(), 1)

  // A second pull reuses the handshake and the prepared remote list.
  const q = await h.started(h.request({ requestId: 'd-2', remoteRequestId: 'r-2' }))
  await h.finish(q, { bytes: 128, micros: 1 }, 1)
  t.ok(q.done)
  t.equal(h.handshakes(), 1, 'one handshake per engine_id')
  t.equal(h.prepares(), 1, "P's region prepared once per handshake")
  h.clean()
})

t.test('the heartbeat record is dropped after a failure too', async (t) => {
  const h = harness(t)
  const p = await h.started(h.request())
  await h.finish(p, natError('NAT_ERR_NIXL_ERR_BACKEND'))
  t.match(p.failure, { error: { code: 'XFA_ERR_READ_FAILED' }, invalidBlockIds: [10, 11], tainted: false })
  t.equal(h.heartbeats.get('p0', 'r-1'), undefined)
  t.same(h.quiesced, [{ requestId: 'd-1', blockIds: [10, 11] }], 'not tainted: quiesced at once')
  t.match(h.reports, [{ outcome: 'read_failed', tainted: false }])
  h.clean()
})

t.test('the check before the READ declines an expired lease: no READ, every local block invalid', async (t) => {
  const h = harness(t)
  // Inside the margin already: E0 − margin is in the past.
  const p = h.start(h.request({ leaseLeftMs: MARGIN - 1, localBlockIds: [5, 6] }))
  await p.promise
  t.equal(h.reads.length, 0, 'readBlocks never called')
  t.match(p.failure, { error: { code: 'XFA_ERR_KV_EXPIRED', statusCode: 410, engineId: 'p0' }, invalidBlockIds: [5, 6], tainted: false })
  t.same(h.quiesced, [{ requestId: 'd-1', blockIds: [5, 6] }])
  t.match(h.reports, [{ outcome: 'kv_expired', expired: { reason: 'no_heartbeat', at: 'before_read' }, beforeReadMs: undefined }])

  // Just outside the margin the same pull is allowed.
  const q = await h.started(h.request({ requestId: 'd-2', leaseLeftMs: MARGIN + 1 }))
  t.equal(h.reads.length, 1, 'READ posted 1 ms before the deadline')
  await h.finish(q, { bytes: 128, micros: 1 })
  t.ok(q.done)
  h.clean()
})

t.test('a lease that ran out while the READ was in flight fails the pull when it completes', async (t) => {
  const h = harness(t)
  const p = await h.started(h.request())
  t.equal(h.reads.length, 1)
  h.clock.advance(LEASE_MS - MARGIN) // exactly at the deadline: not before it
  await h.finish(p, { bytes: 128, micros: 5 })
  t.match(p.failure, { error: { code: 'XFA_ERR_KV_EXPIRED' }, invalidBlockIds: [10, 11], tainted: false })
  t.match(h.reports, [{ outcome: 'kv_expired', expired: { reason: 'no_heartbeat', at: 'after_read' }, readMicros: 5, bytes: 0 }])
  t.same(h.quiesced, [{ requestId: 'd-1', blockIds: [10, 11] }], 'the READ is done: the blocks are reusable at once')
  h.clean()
})

/** Sends a heartbeat for the pull every `every` ms until `until` (monotonic), advancing the clock. */
function heartbeatUntil(h: ReturnType<typeof harness>, every: number, until: number, ok = () => true): void {
  while (h.clock.monotonic() + every <= until) {
    h.clock.advance(every)
    h.heartbeats.sent('p0', 'r-1', ok())
  }
}

t.test('heartbeats sent in an unbroken chain keep a READ past the original expiry alive', async (t) => {
  const h = harness(t)
  const e0 = h.clock.monotonic() + LEASE_MS
  const p = await h.started(h.request())
  // Every lease/6 = 1 s, as the sender does, until 2 s after E0.
  heartbeatUntil(h, LEASE_MS / 6, e0 + 2_000)
  t.ok(h.clock.monotonic() > e0, 'past the original expiry')
  await h.finish(p, { bytes: 128, micros: 5 })
  t.ok(p.done, 'the extended lease covers the READ')
  t.match(h.reports, [{ outcome: 'ok' }])
  h.clean()
})

t.test('broken heartbeat chains do not extend the lease', async (t) => {
  const cases: { name: string; reason: string; beat: (h: ReturnType<typeof harness>, e0: number) => void }[] = [
    {
      name: 'a failed send',
      reason: 'heartbeat_failed',
      beat: (h, e0) => {
        let n = 0
        heartbeatUntil(h, LEASE_MS / 6, e0 + 1_000, () => ++n !== 3)
      },
    },
    {
      name: 'a gap longer than the bound',
      reason: 'heartbeat_gap',
      beat: (h, e0) => {
        // First at +1 s: bound = (2 × 5 s − 2 s) / 3 = 2.67 s; a 3 s gap is over bound − margin.
        h.clock.advance(1_000)
        h.heartbeats.sent('p0', 'r-1', true)
        h.clock.advance(3_000)
        h.heartbeats.sent('p0', 'r-1', true)
        heartbeatUntil(h, 500, e0 + 500)
      },
    },
    {
      name: 'a late first heartbeat',
      reason: 'late_first_heartbeat',
      beat: (h, e0) => {
        // Inside the margin before E0: it may reach P after the lease ran out.
        h.clock.advance(e0 - MARGIN + 1 - h.clock.monotonic())
        h.heartbeats.sent('p0', 'r-1', true)
        heartbeatUntil(h, 500, e0 + 500)
      },
    },
  ]
  for (const c of cases) {
    await t.test(c.name, async (t) => {
      const h = harness(t)
      const e0 = h.clock.monotonic() + LEASE_MS
      const p = await h.started(h.request())
      c.beat(h, e0)
      await h.finish(p, { bytes: 128, micros: 5 })
      t.match(p.failure, { error: { code: 'XFA_ERR_KV_EXPIRED' }, invalidBlockIds: [10, 11] })
      t.match(h.reports, [{ outcome: 'kv_expired', expired: { reason: c.reason, at: 'after_read' } }])
      t.equal(h.quiesced.length, 1)
      h.clean()
    })
  }
})

t.test('checkDeadlines: false (the test switch) lets a stale read through', async (t) => {
  const h = harness(t, { checkDeadlines: false })
  const p = await h.started(h.request({ leaseLeftMs: -60_000 }))
  t.equal(h.reads.length, 1, 'READ posted for a lease that ended a minute ago')
  h.clock.advance(10_000)
  await h.finish(p, { bytes: 128, micros: 5 })
  t.ok(p.done)
  t.match(h.reports, [{ outcome: 'ok', expired: undefined }])
  h.clean()
})

t.test('no expiry exported (null): refused before the handshake, its blocks quiesced at once (issue 18)', async (t) => {
  const h = harness(t, { autoRead: true })
  const p = h.start(h.request({ remoteBlocksExpiryTime: null }))
  await p.promise
  t.match(p.failure, { error: { code: 'XFA_ERR_NO_LEASE_EXPIRY', statusCode: 400 }, invalidBlockIds: [10, 11], tainted: false })
  t.equal(h.handshakes(), 0, 'no handshake')
  t.equal(h.reads.length, 0, 'no READ')
  t.same(h.quiesced, [{ requestId: 'd-1', blockIds: [10, 11] }], 'one pull_quiesced, as for every refusal')
  t.same(h.gaveUp, [], 'refused before it started: P is not told')
  t.same(h.reports, [], 'not an accepted pull')
  // A bad request stays a bad request: the region checks come first.
  const q = h.start(h.request({ requestId: 'd-2', remoteBlocksExpiryTime: null, localBlockIds: [10, NUM_BLOCKS] }))
  await q.promise
  t.match(q.failure, { error: { code: 'XFA_ERR_INVALID_ARG' } })
  h.clean()
})

t.test('allowNoExpiry: a pull without an expiry is read with no lease check, and reported as such', async (t) => {
  const h = harness(t, { autoRead: true, allowNoExpiry: true })
  const p = h.start(h.request({ remoteBlocksExpiryTime: null }))
  await p.promise
  t.ok(p.done)
  t.equal(h.reads.length, 1)
  t.match(h.reports, [{ outcome: 'ok', noExpiry: true }])
  const q = h.start(h.request({ requestId: 'd-2', remoteRequestId: 'r-2' }))
  await q.promise
  t.match(h.reports[1], { outcome: 'ok', noExpiry: false }, 'a pull with an expiry is not counted')
  h.clean()
})

t.test('a tainted READ keeps its blocks until the gate says quiesced', async (t) => {
  const h = harness(t)
  const p = await h.started(h.request({ localBlockIds: [7, 8, 9], remoteBlockIds: [1, 2, 3] }))
  const quiet = deferred<void>()
  const tainted = natError('NAT_ERR_XFER_TAINTED', { ranges: [], quiesced: quiet.promise })
  await h.finish(p, tainted)
  t.match(p.failure, { error: { code: 'XFA_ERR_READ_FAILED', cause: tainted }, invalidBlockIds: [7, 8, 9], tainted: true })
  t.match(h.reports, [{ outcome: 'read_failed', tainted: true }])
  t.equal(h.puller.taintedBlocks, 3, 'counted as tainted')
  h.clock.advance(60_000)
  await flush()
  t.same(h.quiesced, [], 'no pull_quiesced while bytes may still land')
  t.equal(h.heartbeats.get('p0', 'r-1'), undefined, 'heartbeats stop with the failure')

  // The request id is free again at once (the engine may retry into other blocks).
  const retry = await h.started(h.request({ localBlockIds: [0, 1, 2], remoteBlockIds: [1, 2, 3] }))
  await h.finish(retry, { bytes: 192, micros: 5 }, 1)
  t.ok(retry.done)
  t.same(h.quiesced, [], 'still none for the tainted pull')

  quiet.resolve()
  await flush()
  t.same(h.quiesced, [{ requestId: 'd-1', blockIds: [7, 8, 9] }], 'once, after quiesced resolved')
  t.equal(h.puller.taintedBlocks, 0)
  h.clean()
})

t.test('a remote disconnect drops the cached handshake: the next pull handshakes again', async (t) => {
  const h = harness(t)
  const p = await h.started(h.request())
  await h.finish(p, natError('NAT_ERR_REMOTE_DISCONNECT'))
  t.match(p.failure, { error: { code: 'XFA_ERR_PEER_DISCONNECTED', statusCode: 502 }, invalidBlockIds: [10, 11], tainted: false })
  t.match(h.reports, [{ outcome: 'disconnected' }])
  t.equal(h.quiesced.length, 1)
  await flush()
  t.match(h.releases, [{ engineId: 'p0', reason: 'disconnect', loaded: true }], 'old state released')
  t.same(h.forgets, ['p0'])

  const q = await h.started(h.request({ requestId: 'd-2' }))
  t.equal(h.handshakes(), 2, 're-handshaked')
  t.equal(h.prepares(), 2, "P's region prepared again for the new handshake")
  await h.finish(q, { bytes: 128, micros: 1 }, 1)
  t.ok(q.done)
  h.clean()
})

t.test('other READ failures keep the cached handshake', async (t) => {
  const h = harness(t)
  const p = await h.started(h.request())
  await h.finish(p, natError('NAT_ERR_XFER_CANCELED'))
  t.match(p.failure, { error: { code: 'XFA_ERR_PULL_CANCELED' }, tainted: false })
  t.match(h.reports, [{ outcome: 'canceled' }])
  const q = await h.started(h.request({ requestId: 'd-2' }))
  await h.finish(q, { bytes: 128, micros: 1 }, 1)
  t.equal(h.handshakes(), 1)
  h.clean()
})

t.test('peer_gone during the READ aborts it and names the peer gone', async (t) => {
  const h = harness(t)
  const p = await h.started(h.request())
  const signal = h.reads[0]?.opts.signal
  t.equal(signal?.aborted, false)
  const gone = h.peers.peerGone({ engineIds: ['p0'] })
  t.equal(signal?.aborted, true, 'the READ is canceled')
  await h.finish(p, natError('NAT_ERR_XFER_CANCELED'))
  await gone
  t.match(p.failure, { error: { code: 'XFA_ERR_PEER_GONE' } })
  t.match(h.reports, [{ outcome: 'peer_gone' }])
  t.match(h.releases, [{ engineId: 'p0', reason: 'peer_gone' }], 'released once the READ settled')
  const q = h.start(h.request({ requestId: 'd-2' }))
  await q.promise
  t.match(q.failure, { error: { code: 'XFA_ERR_PEER_GONE' } }, 'the next pull fails fast')
  t.equal(h.handshakes(), 1)
  t.equal(h.quiesced.length, 2)
  h.clean()
})

t.test('the engine going away aborts the READ', async (t) => {
  const h = harness(t)
  const ac = new AbortController()
  const p = await h.started(h.request(), ac.signal)
  ac.abort(new Error('engine closed the call'))
  t.equal(h.reads[0]?.opts.signal?.aborted, true)
  await h.finish(p, natError('NAT_ERR_XFER_CANCELED'))
  t.match(p.failure, { error: { code: 'XFA_ERR_PULL_CANCELED' } })
  h.clean()
})

t.test('duplicates are refused: the same request id, or the same remote request', async (t) => {
  const h = harness(t)
  const p = await h.started(h.request())
  const dup = h.start(h.request({ localBlockIds: [12, 13] }))
  await dup.promise
  t.match(dup.failure, { error: { code: 'XFA_ERR_PULL_EXISTS', statusCode: 409 }, invalidBlockIds: [12, 13], tainted: false })
  const sameRemote = h.start(h.request({ requestId: 'd-other', localBlockIds: [14, 15] }))
  await sameRemote.promise
  t.match(sameRemote.failure, { error: { code: 'XFA_ERR_PULL_EXISTS' } })
  t.equal(h.reads.length, 1, 'only the first READ posted')
  t.ok(h.heartbeats.get('p0', 'r-1'), "the refusals leave the first pull's heartbeat record alone")
  await h.finish(p, { bytes: 128, micros: 1 })
  t.ok(p.done)
  t.same(
    h.quiesced,
    [{ requestId: 'd-other', blockIds: [14, 15] }],
    'the refusal under another id gets its pull_quiesced; the duplicate of d-1 none (see below)',
  )
  h.clean()
})

t.test('bad block ids are refused before anything starts', async (t) => {
  const h = harness(t, { autoRead: true })
  const bad: [string, Partial<PullRequest>][] = [
    ['local block out of range', { localBlockIds: [10, NUM_BLOCKS] }],
    ['local block listed twice', { localBlockIds: [10, 10] }],
    ['length mismatch', { localBlockIds: [10], remoteBlockIds: [3, 4] }],
  ]
  for (const [name, over] of bad) {
    const p = h.start(h.request(over))
    await p.promise
    t.match(p.failure, { error: { code: 'XFA_ERR_INVALID_ARG', statusCode: 400 }, invalidBlockIds: over.localBlockIds, tainted: false }, name)
  }
  t.equal(h.handshakes(), 0, 'refused before the handshake')

  // A remote block past P's region is found once the handshake tells the region's size.
  const p = h.start(h.request({ remoteBlockIds: [3, NUM_BLOCKS] }))
  await p.promise
  t.match(p.failure, { error: { code: 'XFA_ERR_INVALID_ARG', message: /remote block 16/ }, invalidBlockIds: [10, 11] })
  t.equal(h.reads.length, 0)
  t.match(h.reports.at(-1), { outcome: 'invalid' })
  t.equal(h.quiesced.length, bad.length + 1)
  h.clean()
})

t.test('no engine attached → XFA_ERR_NOT_ATTACHED', async (t) => {
  const h = harness(t, { target: () => undefined })
  const p = h.start(h.request())
  await p.promise
  t.match(p.failure, { error: { code: 'XFA_ERR_NOT_ATTACHED' }, invalidBlockIds: [10, 11] })
  t.equal(h.quiesced.length, 1)
  h.clean()
})

t.test('a handshake with a region of another block size fails the pull before anything is prepared', async (t) => {
  const h = harness(t, { autoRead: true })
  // Swap the target's block size: P's region (64-byte blocks) no longer matches.
  let prepared = 0
  const other: PullTarget = {
    numBlocks: NUM_BLOCKS,
    blockBytes: 128,
    blocks: blocks(null, NUM_BLOCKS),
    nixl: {
      prepareRemoteBlocks: async () => {
        prepared++
        return blocks('p0', 1)
      },
      readBlocks: async () => ({ bytes: 0, micros: 0 }),
    },
  }
  const puller = new Puller({
    clock: h.clock,
    peers: h.peers,
    heartbeats: h.heartbeats,
    target: () => other,
    leaseMs: LEASE_MS,
    safetyMs: SAFETY_MS,
    readTimeoutMs: 1_000,
    checkDeadlines: true,
    onQuiesced: () => undefined,
  })
  const failure = await puller.pull(h.request(), new AbortController().signal).then(
    () => undefined,
    (f: PullFailure) => f,
  )
  t.match(failure, { error: { code: 'XFA_ERR_HANDSHAKE_FAILED', message: /64-byte blocks, this engine 128/ }, invalidBlockIds: [10, 11] })
  t.equal(prepared, 0, 'nothing prepared for a region that does not fit')
  t.equal(h.heartbeats.size, 0)
  h.clean()
})

t.test('every failed pull calls onQuiesced exactly once', async (t) => {
  const h = harness(t)
  const outcomes: Promise<unknown>[] = []
  const quiet = deferred<void>()
  const failures: [string, Partial<PullRequest> & { leaseLeftMs?: number }, ((r: ReadCall) => void) | undefined][] = [
    ['expired before', { leaseLeftMs: 0 }, undefined],
    ['read failed', {}, (r) => r.d.reject(natError('NAT_ERR_NIXL_ERR_BACKEND'))],
    ['tainted', {}, (r) => r.d.reject(natError('NAT_ERR_XFER_TAINTED', { ranges: [], quiesced: quiet.promise }))],
    ['canceled', {}, (r) => r.d.reject(natError('NAT_ERR_XFER_CANCELED'))],
    ['invalid', { localBlockIds: [99, 98] }, undefined],
  ]
  let n = 0
  for (const [, over, settle] of failures) {
    n++
    const before = h.reads.length
    const p = await h.started(h.request({ requestId: `d-${n}`, remoteRequestId: `r-${n}`, localBlockIds: [2 * n, 2 * n + 1], ...over }))
    const read = h.reads[before]
    t.equal(read !== undefined, settle !== undefined, `pull ${n}: READ posted only where one is expected`)
    if (settle && read) settle(read)
    outcomes.push(p.promise)
    await p.promise
    t.ok(p.failure, `pull ${n} failed`)
  }
  await Promise.all(outcomes)
  quiet.resolve()
  await flush()
  h.clock.advance(60_000)
  await flush()
  const counts = new Map<string, number>()
  for (const q of h.quiesced) counts.set(q.requestId, (counts.get(q.requestId) ?? 0) + 1)
  t.same([...counts.entries()].sort(), failures.map((_, i) => [`d-${i + 1}`, 1]).sort(), 'one event per failed pull')
  // D's word to P, once each pull is quiescent; the invalid one was refused before it started.
  t.same([...h.gaveUp].sort(), ['p0/r-1', 'p0/r-2', 'p0/r-3', 'p0/r-4'], 'each accepted pull told P it is done, once')
  t.equal(h.puller.taintedBlocks, 0)
  h.clean()
})

t.test('a tainted pull tells P it is done only once its READ is quiescent', async (t) => {
  const h = harness(t)
  const quiet = deferred<void>()
  const p = await h.started(h.request())
  await h.finish(p, natError('NAT_ERR_XFER_TAINTED', { ranges: [], quiesced: quiet.promise }))
  t.match(p.failure, { tainted: true })
  t.same(h.gaveUp, [], 'the READ may still read P’s blocks: P is told nothing yet')
  quiet.resolve()
  await flush()
  t.same(h.gaveUp, ['p0/r-1'])
  const ok = await h.started(h.request({ requestId: 'd-2', remoteRequestId: 'r-2' }))
  await h.finish(ok, { bytes: 128, micros: 1 }, 1)
  t.same(h.gaveUp, ['p0/r-1'], 'a pull that read sends only its READ’s own read-done')
  h.clean()
})

// A refused duplicate of a request id still being pulled gets no pull_quiesced: an event under
// that id would read, to an engine keying pulls by id, as the first pull's quiescence, and it
// could reuse blocks that pull may still write. Its 409 answer says nothing was read.
t.test('a refused duplicate does not announce pull_quiesced under the id of the pull in flight', async (t) => {
  const h = harness(t)
  const p = await h.started(h.request())
  const dup = h.start(h.request())
  await dup.promise
  t.match(dup.failure, { error: { code: 'XFA_ERR_PULL_EXISTS' } })
  t.same(h.quiesced, [], 'no event names d-1 while d-1 is still being read')
  await h.finish(p, natError('NAT_ERR_XFER_TAINTED', { ranges: [], quiesced: new Promise(() => undefined) }))
  t.same(h.quiesced, [], 'still none: the first pull is tainted')
})

t.test('a lease already past when its pull arrived samples the clock again, once per half lease; READs in flight go on', async (t) => {
  const h = harness(t)
  const first = await h.started(h.request())
  t.equal(h.reads.length, 1, 'a healthy READ is in flight (6 s of lease left)')
  t.equal(h.handshakes(), 1)

  const late = h.start(h.request({ requestId: 'd-2', remoteRequestId: 'r-2', leaseLeftMs: -1000 }))
  await late.promise
  t.match(late.failure, { error: { code: 'XFA_ERR_KV_EXPIRED' } })
  await flush()
  t.equal(h.handshakes(), 2, 'the clock was sampled again')
  t.same(h.releases, [], 'the same NIXL agent answered: its handshake stays')
  t.notOk(first.settled, 'the healthy READ was not canceled')
  await h.finish(first, { bytes: 128, micros: 1 })
  t.ok(first.done, 'and it succeeds')

  const again = h.start(h.request({ requestId: 'd-3', remoteRequestId: 'r-3', leaseLeftMs: -1000 }))
  await again.promise
  await flush()
  t.equal(h.handshakes(), 2, 'a second late pull within half a lease samples nothing more')

  h.clock.advance(LEASE_MS)
  const inMargin = h.start(h.request({ requestId: 'd-4', remoteRequestId: 'r-4', leaseLeftMs: MARGIN - 1 }))
  await inMargin.promise
  await flush()
  t.match(inMargin.failure, { error: { code: 'XFA_ERR_KV_EXPIRED' } })
  t.equal(h.handshakes(), 2, 'a lease still alive on arrival says nothing about the clock')

  // P's agent restarted under the same engine_id (a new clock epoch, new metadata): the
  // sample finds another NIXL agent, and only then is the handshake dropped.
  h.restartPeer()
  const stale = h.start(h.request({ requestId: 'd-5', remoteRequestId: 'r-5', leaseLeftMs: -1000 }))
  await stale.promise
  await flush()
  await flush()
  t.match(h.releases, [{ engineId: 'p0', reason: 'stale_clock' }], 'another agent answered: the old handshake is dropped')
  const fresh = await h.started(h.request({ requestId: 'd-6', remoteRequestId: 'r-6' }))
  await h.finish(fresh, { bytes: 128, micros: 1 }, 1)
  t.ok(fresh.done, 'pulls go on, on the new handshake')
  t.equal(h.handshakes(), 4)
  h.clean()
})

t.test('an expectation heartbeats before the pull, which takes its record over (issue 17 item 4)', async (t) => {
  const h = harness(t, { autoRead: true })
  const remote = { remoteEngineId: 'p0', remoteRequestId: 'r-1', remoteHost: '127.0.0.1', remotePort: 7000 }
  t.same(h.puller.expect(remote), { ttlMs: LEASE_MS / 2 })
  await flush()
  t.equal(h.handshakes(), 1, 'the handshake starts at once, so heartbeats can go out while the engine waits')
  const record = h.heartbeats.get('p0', 'r-1')
  t.ok(record, 'the heartbeat record starts with the expectation')
  t.equal(h.puller.expected, 1)
  h.clock.advance(1000)
  h.heartbeats.sent('p0', 'r-1', true)
  // Said again before its TTL: it goes on.
  h.clock.advance(LEASE_MS / 2 - 1)
  h.puller.expect(remote)
  h.clock.advance(LEASE_MS / 2 - 1)
  t.ok(h.heartbeats.get('p0', 'r-1'), 'renewed: still heartbeating')
  // The pull arrives: no PULL_EXISTS, the same record (its chain unbroken).
  const p = h.start(h.request())
  t.equal(h.puller.expected, 0, 'taken over')
  await p.promise
  t.ok(p.done, 'the pull succeeds')
  t.equal(h.heartbeats.get('p0', 'r-1'), undefined, 'and ends the record when done')
  t.equal(record?.startedAt, 100_000, 'the record the READ was checked against began with the expectation')
  h.clean()
})

t.test('an expectation not said again lapses: heartbeats stop, as a stalled engine\'s would', async (t) => {
  const h = harness(t)
  const remote = { remoteEngineId: 'p0', remoteRequestId: 'r-9', remoteHost: '127.0.0.1', remotePort: 7000 }
  h.puller.expect(remote)
  h.clock.advance(LEASE_MS / 2 - 1)
  t.ok(h.heartbeats.get('p0', 'r-9'))
  h.clock.advance(1)
  t.equal(h.heartbeats.get('p0', 'r-9'), undefined, 'lapsed after its TTL')
  t.equal(h.puller.expected, 0)
  // A pull in flight heartbeats anyway: an expectation for it changes nothing.
  const p = await h.started(h.request({ remoteRequestId: 'r-2' }))
  t.same(h.puller.expect({ ...remote, remoteRequestId: 'r-2' }), { ttlMs: LEASE_MS / 2 })
  t.equal(h.puller.expected, 0)
  await h.finish(p, { bytes: 128, micros: 1 })
  t.equal(h.heartbeats.get('p0', 'r-2'), undefined, 'the pull ended its record; no expectation kept it')
  // Bounded.
  const few = harness(t, { maxExpected: 2 })
  few.puller.expect({ ...remote, remoteRequestId: 'a' })
  few.puller.expect({ ...remote, remoteRequestId: 'b' })
  t.throws(() => few.puller.expect({ ...remote, remoteRequestId: 'c' }), { code: 'XFA_ERR_TOO_MANY_PULLS' })
  few.puller.expect({ ...remote, remoteRequestId: 'a' })
  t.equal(few.puller.expected, 2, 'saying one again is not another')
  few.puller.clearExpected()
  t.equal(few.heartbeats.size, 0)
  h.clean()
})
