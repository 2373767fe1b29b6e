import t, { type Test } from 'tap'
import { ManualClock } from '../../common/clock.js'
import { deferred, type Deferred } from '../../common/deferred.js'
import type { NixlAgent } from '../../native/agent.js'
import type { ClockSample } from '../../transfer-agent/src/deadline.js'
import {
  DEFAULT_TOMBSTONE_TTL_MS,
  PeerTable,
  type HandshakeResult,
  type PeerGate,
  type PeerLease,
  type PeerRelease,
  type PeerTableOptions,
} from '../../transfer-agent/src/peers.js'

// The native gate satisfies the interface the table drives (checked by tsc only).
const gateShape = (agent: NixlAgent): PeerGate => agent
void gateShape

/** Lets every pending promise continuation run (the table's steps are all microtasks). */
const flush = (): Promise<void> => new Promise((resolve) => setImmediate(resolve))

const sample: ClockSample = { offsetMs: 0, uncertaintyMs: 1, rttMs: 2 }

function answer(engineId: string, md = `md:${engineId}`, probe?: boolean): HandshakeResult {
  return { engineId, metadata: Buffer.from(md), clock: sample, ...(probe === undefined ? {} : { probe }) }
}

interface HandshakeCall {
  address: string
  expected: string
  signal: AbortSignal
  d: Deferred<HandshakeResult>
}

/**
 * Fake handshake and gate on deferreds. `log` records every gate call in order, and each
 * release as `release <id> <reason>`. Loads and forgets resolve at once unless `holdLoads`
 * / `holdForgets`; then the test settles `loads[i].d` / `forgets[i].d` itself.
 */
function harness(t: Test, opts: { holdLoads?: boolean; holdForgets?: boolean } & Partial<PeerTableOptions> = {}) {
  const clock = new ManualClock()
  const log: string[] = []
  const handshakes: HandshakeCall[] = []
  const loads: { engineId: string; md: string; probe: boolean | undefined; d: Deferred<unknown> }[] = []
  const forgets: { engineId: string; d: Deferred<void> }[] = []
  const releases: PeerRelease[] = []
  const gate: PeerGate = {
    loadPeer(engineId, md, o) {
      log.push(`load ${engineId} ${md.toString()}`)
      const d = deferred<unknown>()
      loads.push({ engineId, md: md.toString(), probe: o?.probe, d })
      if (!opts.holdLoads) d.resolve({ engineId })
      return d.promise
    },
    forgetPeer(engineId) {
      log.push(`forget ${engineId}`)
      const d = deferred<void>()
      forgets.push({ engineId, d })
      if (!opts.holdForgets) d.resolve()
      return d.promise
    },
  }
  const table = new PeerTable({
    clock,
    gate,
    handshake: (address, expected, signal) => {
      log.push(`handshake ${address} ${expected}`)
      const d = deferred<HandshakeResult>()
      handshakes.push({ address, expected, signal, d })
      return d.promise
    },
    onRelease: (r) => {
      releases.push(r)
      log.push(`release ${r.engineId} ${r.reason}`)
    },
    ...opts,
  })
  const forgetCount = (id: string) => forgets.filter((f) => f.engineId === id).length
  /** acquire, with the outcome captured so a test can look at it before it settles. */
  const start = (engineId: string, address: string) => {
    const out: { lease?: PeerLease; error?: { code?: string }; settled: boolean } = { settled: false }
    const p = table.acquire(engineId, address).then(
      (lease) => Object.assign(out, { lease, settled: true }),
      (error: { code?: string }) => Object.assign(out, { error, settled: true }),
    )
    return Object.assign(out, { done: p })
  }
  /** A cached peer: handshake answered, loaded, a first lease released again. */
  const ready = async (engineId: string, address: string, md?: string) => {
    const a = start(engineId, address)
    handshakes.at(-1)?.d.resolve(answer(engineId, md))
    await a.done
    t.ok(a.lease, `${engineId} acquired`)
    a.lease?.release()
  }
  return { clock, log, handshakes, loads, forgets, releases, gate, table, forgetCount, start, ready }
}

t.test('one handshake per engine_id, shared by concurrent acquires; metadata cached', async (t) => {
  const h = harness(t)
  const a = h.start('p0', 'h:1')
  const b = h.start('p0', 'h:1')
  await flush()
  t.equal(h.handshakes.length, 1, 'one handshake in flight for both')
  t.same([h.handshakes[0]?.address, h.handshakes[0]?.expected], ['h:1', 'p0'])
  t.same(h.table.peers(), [{ engineId: 'p0', address: 'h:1', state: 'handshaking', reads: 0 }])
  h.handshakes[0]?.d.resolve(answer('p0', 'meta', true))
  await Promise.all([a.done, b.done])
  t.same(h.loads.map((l) => [l.engineId, l.md, l.probe]), [['p0', 'meta', true]], 'loaded once, with the advertised probe')
  t.equal(a.lease?.metadata.toString(), 'meta')
  t.same([a.lease?.engineId, a.lease?.address, a.lease?.probe, a.lease?.clock], ['p0', 'h:1', true, sample])
  t.equal(h.table.reads('p0'), 2, 'each acquire is one READ')

  // Cached: no new handshake, whatever address a later pull names.
  const c = h.start('p0', 'elsewhere:9')
  await c.done
  t.equal(h.handshakes.length, 1)
  t.equal(c.lease?.address, 'h:1')
  t.equal(h.table.reads('p0'), 3)
  a.lease?.release()
  a.lease?.release()
  t.equal(h.table.reads('p0'), 2, 'a double release counts once')
  b.lease?.release()
  c.lease?.release()
  t.equal(h.table.reads('p0'), 0)
  t.same(h.table.peers(), [{ engineId: 'p0', address: 'h:1', state: 'ready', reads: 0 }])
  t.equal(h.forgets.length, 0, 'an idle cached peer is kept')

  const probeLess = h.start('p1', 'h:2')
  await flush()
  h.handshakes[1]?.d.resolve(answer('p1'))
  await probeLess.done
  t.equal(h.loads[1]?.probe, false, 'no advertised probe → loaded without it')
})

t.test('a failed handshake or load caches nothing and the next acquire retries', async (t) => {
  const h = harness(t, { holdLoads: true })
  const a = h.start('p0', 'h:1')
  const b = h.start('p0', 'h:1')
  await flush()
  const cause = new Error('ECONNREFUSED')
  h.handshakes[0]?.d.reject(cause)
  await Promise.all([a.done, b.done])
  t.equal(a.error?.code, 'XFA_ERR_HANDSHAKE_FAILED')
  t.equal(b.error, a.error, 'the waiters share the failure')
  t.equal((a.error as { cause?: unknown }).cause, cause)
  t.same(h.table.peers(), [])

  const c = h.start('p0', 'h:1')
  await flush()
  t.equal(h.handshakes.length, 2, 'retried')
  h.handshakes[1]?.d.resolve(answer('p0'))
  await flush()
  h.loads[0]?.d.reject(Object.assign(new Error('bad md'), { code: 'NAT_ERR_METADATA_REJECTED' }))
  await c.done
  t.equal(c.error?.code, 'XFA_ERR_HANDSHAKE_FAILED', 'a refused load is a failed handshake')
  t.match((c.error as { cause?: { code?: string } }).cause, { code: 'NAT_ERR_METADATA_REJECTED' })
  t.equal(h.forgets.length, 0, 'nothing loaded, nothing to forget')
  t.same(h.table.peers(), [])
  t.equal(h.table.isGone('p0'), false)
})

t.test('the answer must name the expected engine_id', async (t) => {
  const h = harness(t)
  const a = h.start('p0', 'h:1')
  await flush()
  h.handshakes[0]?.d.resolve(answer('p9'))
  await a.done
  t.equal(a.error?.code, 'XFA_ERR_ENGINE_ID_MISMATCH')
  t.match(a.error, { engineId: 'p0', address: 'h:1' })
  t.same(h.loads, [], 'nothing loaded')
  t.same(h.table.peers(), [], 'nothing cached')
  t.equal(h.table.isGone('p0'), false, 'p0 was never known at h:1: not released')
  t.equal(h.table.isGone('p9'), false)

  // Nothing cached under p9 either: a pull naming p9 handshakes for itself.
  const b = h.start('p9', 'h:1')
  await flush()
  t.equal(h.handshakes.length, 2)
  h.handshakes[1]?.d.resolve(answer('p9'))
  await b.done
  t.ok(b.lease)
})

t.test('peer_gone: fail fast, forget once after the last READ, idempotent', async (t) => {
  const h = harness(t)
  const a = h.start('p0', 'h:1')
  const b = h.start('p0', 'h:1')
  await flush()
  h.handshakes[0]?.d.resolve(answer('p0'))
  await Promise.all([a.done, b.done])
  t.equal(h.table.reads('p0'), 2)

  let goneDone = false
  const gone = h.table.peerGone({ engineIds: ['p0'] }).then(() => (goneDone = true))
  t.ok(a.lease?.signal.aborted, 'held leases see the release')
  t.match(a.lease?.signal.reason, { code: 'XFA_ERR_PEER_GONE' })
  const late = h.start('p0', 'h:1')
  await late.done
  t.equal(late.error?.code, 'XFA_ERR_PEER_GONE', 'new acquires fail fast')
  t.equal(h.handshakes.length, 1, '… without a handshake')
  t.equal(h.table.isGone('p0'), true)
  t.same(h.table.peers(), [{ engineId: 'p0', address: 'h:1', state: 'releasing', reads: 2 }])

  const again = h.table.peerGone({ engineIds: ['p0'] })
  await flush()
  t.equal(h.forgets.length, 0, 'not while READs are in flight')
  a.lease?.release()
  a.lease?.release()
  await flush()
  t.equal(h.forgets.length, 0, 'a double release does not count as the last one')
  b.lease?.release()
  t.same(h.log.filter((l) => l.startsWith('forget')), ['forget p0'], 'forgotten at the last release')
  await gone
  await again
  t.ok(goneDone, 'peerGone resolves once released')
  t.same(h.releases, [{ engineId: 'p0', address: 'h:1', reason: 'peer_gone', loaded: true }])
  t.same(h.table.peers(), [])

  await h.table.peerGone({ engineIds: ['p0'] })
  await h.table.peerGone({ addresses: ['h:1'] })
  t.equal(h.forgetCount('p0'), 1, 'exactly once in all')
  t.equal(h.releases.length, 1)
})

t.test('peer_gone for an unknown engine_id or address calls nothing, but the id stays gone', async (t) => {
  const h = harness(t)
  await h.ready('p0', 'h:1')
  await h.table.peerGone({ engineIds: ['nobody'], addresses: ['nowhere:1'] })
  await h.table.peerGone({})
  t.same(h.forgets, [])
  t.same(h.releases, [])
  t.same(h.table.peers(), [{ engineId: 'p0', address: 'h:1', state: 'ready', reads: 0 }], 'others untouched')
  const late = h.start('nobody', 'h:7')
  await late.done
  t.equal(late.error?.code, 'XFA_ERR_PEER_GONE', 'a late prefill answer naming it fails fast')
  t.equal(h.handshakes.length, 1)
})

t.test('peer_gone by address releases the engine_ids there, not the address', async (t) => {
  const h = harness(t)
  await h.ready('p0', 'h:1')
  await h.ready('p1', 'h:2')
  const c = h.start('p2', 'h:1') // another engine handshaking at h:1
  await flush()
  const gone = h.table.peerGone({ addresses: ['h:1'] })
  await c.done
  t.equal(c.error?.code, 'XFA_ERR_PEER_GONE', 'the handshake in flight there fails too')
  t.ok(h.handshakes[2]?.signal.aborted, 'and is aborted')
  h.handshakes[2]?.d.reject(h.handshakes[2].signal.reason)
  await gone
  t.same(h.log.filter((l) => l.startsWith('forget')), ['forget p0'])
  t.same([h.table.isGone('p0'), h.table.isGone('p2'), h.table.isGone('p1')], [true, true, false])
  t.same(h.table.peers().map((p) => p.engineId), ['p1'])
  // A restarted engine at the same address, with a new engine_id, is welcome.
  const d = h.start('p3', 'h:1')
  await flush()
  h.handshakes[3]?.d.resolve(answer('p3'))
  await d.done
  t.ok(d.lease)
  t.same(h.releases.map((r) => [r.engineId, r.reason, r.loaded]), [['p0', 'peer_gone', true], ['p2', 'peer_gone', false]])
})

t.test('peer_gone while the handshake is in flight: waiters fail at once, nothing loaded', async (t) => {
  const h = harness(t)
  const a = h.start('p0', 'h:1')
  const b = h.start('p0', 'h:1')
  await flush()
  const hs = h.handshakes[0]
  let goneDone = false
  const gone = h.table.peerGone({ engineIds: ['p0'] }).then(() => (goneDone = true))
  await Promise.all([a.done, b.done])
  t.equal(a.error?.code, 'XFA_ERR_PEER_GONE')
  t.equal(b.error?.code, 'XFA_ERR_PEER_GONE')
  t.ok(hs?.signal.aborted, 'the handshake is told to stop')
  t.notOk(goneDone, 'not released while the handshake is in flight')
  t.same(h.table.peers(), [{ engineId: 'p0', address: 'h:1', state: 'releasing', reads: 0 }])
  // The handshake ignores the signal and answers anyway: it must not be loaded.
  hs?.d.resolve(answer('p0'))
  await gone
  t.same(h.loads, [])
  t.same(h.forgets, [])
  t.same(h.releases, [{ engineId: 'p0', address: 'h:1', reason: 'peer_gone', loaded: false }])

  // Same, with the handshake rejecting on abort.
  const c = h.start('p1', 'h:2')
  await flush()
  const gone1 = h.table.peerGone({ engineIds: ['p1'] })
  h.handshakes[1]?.d.reject(h.handshakes[1].signal.reason)
  await gone1
  await c.done
  t.equal(c.error?.code, 'XFA_ERR_PEER_GONE', 'the waiter sees peer_gone, not the abort')
  t.same(h.forgets, [])
})

t.test('peer_gone while the gate loads: forget only after the load settles', async (t) => {
  const h = harness(t, { holdLoads: true })
  const a = h.start('p0', 'h:1')
  await flush()
  h.handshakes[0]?.d.resolve(answer('p0'))
  await flush()
  t.equal(h.loads.length, 1, 'loading')
  const gone = h.table.peerGone({ engineIds: ['p0'] })
  await a.done
  t.equal(a.error?.code, 'XFA_ERR_PEER_GONE', 'the waiter fails at once')
  await flush()
  t.same(h.forgets, [], 'not forgotten under the load')
  h.loads[0]?.d.resolve({})
  await gone
  t.same(h.log, ['handshake h:1 p0', 'load p0 md:p0', 'forget p0', 'release p0 peer_gone'])

  // A load that fails after peer_gone leaves nothing to forget.
  const b = h.start('p1', 'h:2')
  await flush()
  h.handshakes[1]?.d.resolve(answer('p1'))
  await flush()
  const gone1 = h.table.peerGone({ engineIds: ['p1'] })
  h.loads[1]?.d.reject(new Error('refused'))
  await gone1
  await b.done
  t.equal(b.error?.code, 'XFA_ERR_PEER_GONE')
  t.equal(h.forgetCount('p1'), 0)
  t.match(h.releases.at(-1), { engineId: 'p1', loaded: false })
})

t.test('a new engine_id at a known address releases the old one, even under a READ', async (t) => {
  const h = harness(t)
  await h.ready('p0', 'h:1')
  const read = h.start('p0', 'h:1')
  await read.done
  t.equal(h.table.reads('p0'), 1, 'a READ to p0 in flight')

  // P restarted at h:1 as p1; a pull names p1.
  const next = h.start('p1', 'h:1')
  await flush()
  h.handshakes[1]?.d.resolve(answer('p1'))
  await next.done
  t.ok(next.lease, 'the new engine is served')
  t.ok(read.lease?.signal.aborted, 'the READ to p0 is told')
  t.match(read.lease?.signal.reason, { code: 'XFA_ERR_PEER_GONE' })
  const late = h.start('p0', 'h:1')
  await late.done
  t.equal(late.error?.code, 'XFA_ERR_PEER_GONE', 'a late answer naming p0 fails fast, without the router')
  t.equal(h.forgetCount('p0'), 0, 'p0 kept while its READ is in flight')
  read.lease?.release()
  await flush()
  t.same(h.log, ['handshake h:1 p0', 'load p0 md:p0', 'handshake h:1 p1', 'load p1 md:p1', 'forget p0', 'release p0 engine_id_changed'])
  t.same(h.table.peers(), [{ engineId: 'p1', address: 'h:1', state: 'ready', reads: 1 }])
  // peer_gone arriving later for p0 is a no-op; for the address it means p1.
  await h.table.peerGone({ engineIds: ['p0'] })
  t.equal(h.forgetCount('p0'), 1)
})

t.test('a mismatch at the address where the expected engine lived releases it', async (t) => {
  const h = harness(t)
  await h.ready('p0', 'h:1')
  t.ok(h.table.markDisconnected('p0'), 'p0 dropped after a disconnect')
  await flush()
  t.equal(h.forgetCount('p0'), 1)
  const a = h.start('p0', 'h:1')
  await flush()
  h.handshakes[1]?.d.resolve(answer('p1')) // h:1 is p1 now
  await a.done
  t.equal(a.error?.code, 'XFA_ERR_ENGINE_ID_MISMATCH')
  t.equal(h.table.isGone('p0'), true, 'p0 is dead: later pulls fail fast instead of re-handshaking')
  const b = h.start('p0', 'h:1')
  await b.done
  t.equal(b.error?.code, 'XFA_ERR_PEER_GONE')
  t.equal(h.handshakes.length, 2)
  t.equal(h.forgetCount('p0'), 1, 'already forgotten: not again')
})

t.test('disconnect: the cached handshake is dropped, forgotten once idle, then re-handshaken', async (t) => {
  const h = harness(t, { holdForgets: true })
  await h.ready('p0', 'h:1', 'md-a')
  const r1 = h.start('p0', 'h:1')
  const r2 = h.start('p0', 'h:1')
  await Promise.all([r1.done, r2.done])

  // r1's READ failed with a remote disconnect.
  t.ok(r1.lease?.markDisconnected())
  t.notOk(h.table.markDisconnected('p0'), 'twice: nothing more to drop')
  t.match(r2.lease?.signal.reason, { code: 'XFA_ERR_PEER_DISCONNECTED' })
  t.equal(h.table.isGone('p0'), false, 'a disconnect is not a tombstone')
  r1.lease?.release()
  await flush()
  t.same(h.forgets, [], 'r2 still in flight')

  // The next pull re-handshakes at once, but loads only after the old state is forgotten.
  const r3 = h.start('p0', 'h:1')
  await flush()
  t.equal(h.handshakes.length, 2, 're-handshakes instead of failing forever')
  t.notOk(h.table.markDisconnected('p0'), 'a disconnect during the handshake drops nothing')
  h.handshakes[1]?.d.resolve(answer('p0', 'md-b'))
  await flush()
  t.equal(h.loads.length, 1, 'not loaded over the old state')
  t.equal(h.table.reads('p0'), 1)
  r2.lease?.release()
  await flush()
  t.equal(h.forgets.length, 1, 'forgotten once the last old READ settled')
  t.equal(h.loads.length, 1, '… and loaded only after the forget resolves')
  h.forgets[0]?.d.resolve()
  await r3.done
  t.same(h.log, [
    'handshake h:1 p0',
    'load p0 md-a',
    'handshake h:1 p0',
    'forget p0',
    'release p0 disconnect',
    'load p0 md-b',
  ])
  t.equal(r3.lease?.metadata.toString(), 'md-b')
  t.notOk(r3.lease?.signal.aborted)

  // A stale lease of the old generation cannot drop the new one.
  t.notOk(r1.lease?.markDisconnected())
  t.same(h.table.peers(), [{ engineId: 'p0', address: 'h:1', state: 'ready', reads: 1 }])
  r3.lease?.release()

  // Idle: forgotten at once.
  t.ok(h.table.markDisconnected('p0'))
  t.equal(h.forgets.length, 2)
  t.notOk(h.table.markDisconnected('unknown'))
})

t.test('peer_gone while a disconnected generation is still releasing', async (t) => {
  const h = harness(t)
  await h.ready('p0', 'h:1')
  const r = h.start('p0', 'h:1')
  await r.done
  h.table.markDisconnected('p0')
  const re = h.start('p0', 'h:1') // re-handshake waiting behind the old generation
  await flush()
  h.handshakes[1]?.d.resolve(answer('p0', 'md-new'))
  await flush()
  let goneDone = false
  const gone = h.table.peerGone({ addresses: ['h:1'] }).then(() => (goneDone = true))
  await re.done
  t.equal(re.error?.code, 'XFA_ERR_PEER_GONE')
  await flush()
  t.notOk(goneDone, 'waits for the READ of the old generation')
  r.lease?.release()
  await gone
  t.same(h.loads.map((l) => l.md), ['md:p0'], 'the new metadata is never loaded')
  t.equal(h.forgetCount('p0'), 1)
  t.same(h.releases.map((x) => [x.reason, x.loaded]), [['peer_gone', false], ['disconnect', true]])
})

t.test('an acquire that waited across a disconnect re-handshakes', async (t) => {
  // The window is between the handshake becoming ready and the waiting acquire's
  // continuation: scan the microtask offsets across it, one fresh table each.
  let hit = 0
  for (let k = 0; k < 12; k++) {
    const h = harness(t)
    const a = h.start('p0', 'h:1')
    await flush()
    h.handshakes[0]?.d.resolve(answer('p0'))
    for (let i = 0; i < k; i++) await Promise.resolve()
    // reads 0: the acquire has not taken its lease yet (it resumes after this).
    if (h.table.reads('p0') === 0 && h.table.markDisconnected('p0')) {
      await flush()
      t.equal(h.handshakes.length, 2, `offset ${k}: the waiting acquire started a new handshake`)
      h.handshakes[1]?.d.resolve(answer('p0', 'md-2'))
      await a.done
      t.equal(a.lease?.metadata.toString(), 'md-2', 'served by the new handshake')
      t.same(h.log.filter((l) => l.startsWith('forget')), ['forget p0'])
      hit++
    }
    await a.done
    t.ok(a.lease, `offset ${k}: served`)
  }
  t.ok(hit > 0, 'the window was hit')
})

t.test('tombstones expire on the injected clock and are bounded in number', async (t) => {
  const h = harness(t, { tombstoneTtlMs: 1_000, maxTombstones: 2 })
  await h.table.peerGone({ engineIds: ['a', 'b'] })
  t.equal(h.table.tombstones, 2)
  h.clock.advance(500)
  await h.table.peerGone({ engineIds: ['c'] })
  t.same([h.table.isGone('a'), h.table.isGone('b'), h.table.isGone('c')], [false, true, true], 'the oldest goes first')
  h.clock.advance(500)
  t.equal(h.table.isGone('b'), false, 'expired after the TTL')
  t.equal(h.table.isGone('c'), true)
  t.equal(h.table.tombstones, 1)
  h.clock.advance(500)
  t.equal(h.table.tombstones, 0)
  const again = h.start('c', 'h:1')
  await flush()
  t.equal(h.handshakes.length, 1, 'an expired tombstone lets the id handshake again')
  h.handshakes[0]?.d.resolve(answer('c'))
  await again.done
  t.ok(again.lease)
  t.equal(DEFAULT_TOMBSTONE_TTL_MS, 600_000)
})

t.test('arguments, options and a throwing onRelease', async (t) => {
  const h = harness(t)
  const bad = [h.start('', 'h:1'), h.start('p0', '')]
  await Promise.all(bad.map((b) => b.done))
  t.same(bad.map((b) => b.error?.code), ['XFA_ERR_INVALID_ARG', 'XFA_ERR_INVALID_ARG'])
  const base = { clock: new ManualClock(), gate: h.gate, handshake: () => Promise.reject(new Error('x')) }
  t.throws(() => new PeerTable({ ...base, tombstoneTtlMs: 0 }), { code: 'XFA_ERR_INVALID_ARG' })
  t.throws(() => new PeerTable({ ...base, maxTombstones: 1.5 }), { code: 'XFA_ERR_INVALID_ARG' })

  let calls = 0
  const forgot: string[] = []
  const table = new PeerTable({
    clock: new ManualClock(),
    gate: { loadPeer: async () => ({}), forgetPeer: async (id) => void forgot.push(id) },
    handshake: async (_address, expected) => answer(expected),
    onRelease: () => {
      calls++
      throw new Error('logger down')
    },
  })
  const lease = await table.acquire('p0', 'h:1')
  lease.release()
  await table.peerGone({ engineIds: ['p0'] })
  t.same([calls, forgot], [1, ['p0']], 'reported once; cleanup unaffected')
  t.same(table.peers(), [])
})

t.test('a forgetPeer that rejects is reported and still ends the generation', async (t) => {
  const h = harness(t, { holdForgets: true })
  await h.ready('p0', 'h:1')
  const gone = h.table.peerGone({ engineIds: ['p0'] })
  const err = new Error('agent closed')
  h.forgets[0]?.d.reject(err)
  await gone
  t.same(h.releases, [{ engineId: 'p0', address: 'h:1', reason: 'peer_gone', loaded: true, error: err }])
  t.same(h.table.peers(), [])
})

t.test('revive lifts tombstones (the router saw the engine answering again): the next acquire handshakes', async (t) => {
  const h = harness(t)
  await h.table.peerGone({ engineIds: ['p0'] })
  await t.rejects(h.table.acquire('p0', 'h:1'), { code: 'XFA_ERR_PEER_GONE' })
  t.equal(h.handshakes.length, 0, 'gone: failed fast, no handshake')
  t.equal(h.table.revive(['p0', 'never-gone']), 1, 'one tombstone lifted')
  t.notOk(h.table.isGone('p0'))
  const a = h.start('p0', 'h:1')
  await flush()
  t.equal(h.handshakes.length, 1, 'handshaking again')
  h.handshakes[0]?.d.resolve(answer('p0', 'meta', true))
  await a.done
  t.equal(h.table.peers()[0]?.state, 'ready')
})
