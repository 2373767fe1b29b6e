import t from 'tap'
import { ManualClock } from '../../common/clock.js'
import { RTR_ERR_STORE_UNAVAILABLE } from '../../router/src/errors.js'
import type { PeerGoneTarget } from '../../router/src/events/router-events.js'
import { MemoryLeaseLedger } from '../../router/src/leases/memory-ledger.js'
import { Drainer } from '../../router/src/topology/drainer.js'
import { TopologyRegistry } from '../../router/src/topology/registry.js'

// The drain rules on a hand-driven clock: a prefiller is drained when no request is in flight
// on it and no lease it issued is unread; then it leaves the topology, with peer_gone when its
// engine is going away. A decoder that goes down or leaves keeps its leases (issue 17).

function setup() {
  const clock = new ManualClock()
  const registry = new TopologyRegistry({
    clock,
    policy: { unhealthyThreshold: 1, baseEjectionMs: 1000, maxEjectionMs: 1000 },
    instances: [
      { id: 'p0', role: 'prefill', url: 'http://127.0.0.1:9001' },
      { id: 'd0', role: 'decode', url: 'http://127.0.0.1:9002' },
      { id: 'd1', role: 'decode', url: 'http://127.0.0.1:9003' },
    ],
  })
  const released: string[][] = []
  const ledger = new MemoryLeaseLedger({ clock, leaseSeconds: 30, marginMs: 1000, retentionMs: 1000, maxEntries: 100, onRelease: (ls) => released.push(ls.map((l) => l.requestId)) })
  const gone: { target: PeerGoneTarget; reason: string }[] = []
  // p0's engine_id, as its prefill answers told the registry (an agent's claim never counts).
  registry.observeEngineId('p0', 'eng-p0')
  const events = {
    peerGone: (target: PeerGoneTarget, reason: string) => {
      gone.push({ target, reason })
      return { seq: gone.length, engineIds: [...(target.engineIds ?? [])], unknown: [], aliveSkipped: [], logged: true }
    },
  }
  const drainer = new Drainer({ registry, ledger, events, clock, logger: { info: () => {} }, pollMs: 100 })
  t.teardown(() => drainer.close())
  const lease = (id: string, decode = 'd0') => ({ requestId: id, clientRequestId: id, prefill: 'p0', decode, engineId: 'eng-p0', remoteRequestId: `x-${id}`, issuedAt: clock.now() })
  return { clock, registry, ledger, drainer, gone, released, lease }
}

const tick = (): Promise<void> => new Promise((r) => setImmediate(r))

t.test('an idle instance drains at once: peer_gone for its engine_ids, then it is gone', async (t) => {
  const { registry, drainer, gone } = setup()
  registry.observeEngineId('p0', 'eng-p0')
  const s = await drainer.drain('p0')
  t.same(s, { id: 'p0', drained: true, removed: true, inflight: 0, unreadLeases: 0 })
  t.same(gone, [{ target: { engineIds: ['eng-p0'] }, reason: 'drained: instance p0' }])
  t.notOk(registry.has('p0'))
  await t.rejects(drainer.drain('p0'), { code: 'RTR_ERR_INSTANCE_NOT_FOUND' })
  t.same(await drainer.wait('p0', 10), { id: 'p0', drained: false, removed: true, inflight: 0, unreadLeases: 0 }, 'nothing pending: where it stands')
})

t.test('out of routing is not gone: a drain with peerGone false removes the instance without peer_gone; a later going-away drain adds it', async (t) => {
  const { registry, drainer, gone } = setup()
  registry.observeEngineId('p0', 'eng-p0')
  const s = await drainer.drain('p0', { peerGone: false })
  t.match(s, { drained: true, removed: true })
  t.same(gone, [], 'no peer_gone: its engine may come back under the same engine_id')
  t.notOk(registry.has('p0'))

  registry.add({ id: 'p9', role: 'prefill', url: 'http://127.0.0.1:9009' })
  registry.observeEngineId('p9', 'eng-p9')
  registry.acquire('p9')
  t.match(await drainer.drain('p9', { peerGone: false }), { drained: false })
  // Not Ready first, then terminating: the pod is going away after all.
  await drainer.drain('p9', { peerGone: true })
  await drainer.drain('p9', { peerGone: false })
  registry.release('p9')
  await tick()
  await tick()
  t.notOk(registry.has('p9'))
  t.same(gone.map((g) => g.target.engineIds), [['eng-p9']], 'once any drain call said it is going away, it ends with peer_gone')
})

t.test('a prefiller waits for its requests in flight, then for the leases it issued to be read', async (t) => {
  const { clock, registry, ledger, drainer, gone } = setup()
  registry.acquire('p0')
  let s = await drainer.drain('p0')
  t.same(s, { id: 'p0', drained: false, removed: false, inflight: 1, unreadLeases: 0 })
  t.ok(registry.snapshot().instances.find((i) => i.id === 'p0')?.draining, 'admits nothing new')
  const waited = drainer.wait('p0', 60_000)
  // P answered: the lease first, then P's slot back (handoff.ts keeps this order).
  ledger.issue(lease('r1'))
  registry.release('p0')
  await tick()
  t.same(await drainer.status('p0'), { id: 'p0', drained: false, removed: false, inflight: 0, unreadLeases: 1 })
  t.same(gone, [])
  ledger.reading('r1')
  ledger.done('r1')
  s = await waited
  t.same(s, { id: 'p0', drained: true, removed: true, inflight: 0, unreadLeases: 0 })
  t.equal(gone.length, 1)
  t.notOk(registry.has('p0'))
  t.equal(clock.pendingTimers, 0, 'no timer left behind')

  function lease(id: string) {
    return { requestId: id, clientRequestId: id, prefill: 'p0', decode: 'd0', engineId: 'eng-p0', issuedAt: clock.now() }
  }
})

t.test('a wait that runs out says what was left; the drain goes on and completes when the lease lapses', async (t) => {
  const { clock, ledger, drainer, registry, lease } = setup()
  ledger.issue(lease('r1'))
  await drainer.drain('p0')
  const waited = drainer.wait('p0', 5000)
  clock.advance(5000)
  t.same(await waited, { id: 'p0', drained: false, removed: false, inflight: 0, unreadLeases: 1 })
  t.ok(registry.has('p0'), 'still in the topology, still draining')
  t.same((await drainer.drain('p0')).unreadLeases, 1, 'draining again is the same drain')
  // The lease was never read: at its expiry P frees the blocks itself; the poll notices.
  clock.advance(25_000)
  await tick()
  t.notOk(registry.has('p0'))
})

t.test('a caller that hangs up stops waiting; a DELETE during a drain ends it undrained', async (t) => {
  const { registry, drainer, gone } = setup()
  registry.acquire('p0')
  await drainer.drain('p0')
  const ac = new AbortController()
  const a = drainer.wait('p0', 60_000, ac.signal)
  ac.abort()
  t.same(await a, { id: 'p0', drained: false, removed: false, inflight: 1, unreadLeases: 0 })
  const b = drainer.wait('p0', 60_000)
  const r = await drainer.remove('p0', 'deregistered')
  t.same(r, { id: 'p0', peerGoneSeq: 1, engineIds: ['eng-p0'] })
  t.same(gone[0]?.reason, 'deregistered')
  t.same(await b, { id: 'p0', drained: false, removed: true, inflight: 0, unreadLeases: 0 })
  await t.rejects(drainer.remove('p0', 'again'), { code: 'RTR_ERR_INSTANCE_NOT_FOUND' })
  registry.release('p0')
  t.pass('a slot released after removal is a no-op')
})

t.test('a decoder that goes down or leaves: its leases stay P\'s (out of routing is not gone; D may be reading)', async (t) => {
  const { registry, ledger, drainer, released, lease } = setup()
  ledger.issue(lease('r1', 'd0'))
  ledger.issue(lease('r2', 'd1'))
  ledger.issue(lease('r3', 'd1'))
  ledger.reading('r1')
  ledger.reading('r3')
  registry.recordProbe('d0', true)
  registry.recordProbe('d0', false)
  t.notOk(registry.snapshot().instances.find((i) => i.id === 'd0')?.healthy, 'd0 is down')
  t.same(released, [], 'd0 went down: nothing released')
  const r = await drainer.remove('d1', 'deregistered')
  t.same(r.peerGoneSeq, null, 'no engine_id known for d1: no peer_gone')
  await tick()
  t.same(released, [], 'd1 left: nothing released')
  t.equal(await ledger.unreadBy('p0'), 3, 'every lease still counts for P')
})

t.test('a decoder drains on its requests in flight alone', async (t) => {
  const { registry, drainer, ledger, lease } = setup()
  // A lease whose decoder is d0 is P's to count, not d0's: d0's slot stands for it.
  ledger.issue(lease('r1', 'd0'))
  registry.acquire('d0')
  t.same((await drainer.drain('d0')).inflight, 1)
  registry.release('d0')
  await tick()
  t.notOk(registry.has('d0'))
})

t.test('a ledger that cannot count (a shared one, Redis away) and a peer_gone that fails: nothing is decided until both work', async (t) => {
  const { clock, registry, ledger, drainer, gone } = setup()
  const warned: string[] = []
  let counting = false
  let peerGoneFails = true
  const unreadBy = async (id: string): Promise<number> => {
    if (!counting) throw new RTR_ERR_STORE_UNAVAILABLE('test')
    return ledger.unreadBy(id)
  }
  // The memory ledger, but for unreadBy.
  const flaky = new Proxy(ledger, {
    get: (target, prop) => (prop === 'unreadBy' ? unreadBy : (Reflect.get(target, prop) as () => unknown).bind(target)),
  })
  const events = {
    peerGone: async () => {
      if (peerGoneFails) throw new Error('event store unavailable')
      gone.push({ target: {}, reason: 'async' })
      return { seq: 7, engineIds: ['eng-p0'], unknown: [], aliveSkipped: [], logged: true }
    },
    agents: { all: () => [] },
  }
  registry.observeEngineId('p0', 'eng-p0')
  const d = new Drainer({ registry, ledger: flaky, events, clock, logger: { info: () => {}, warn: (_o, msg) => void warned.push(msg) }, pollMs: 100 })
  t.teardown(() => d.close())
  drainer.close()
  await t.rejects(d.drain('p0'), { code: 'RTR_ERR_STORE_UNAVAILABLE' }, 'the answer fails…')
  t.ok(registry.snapshot().instances.find((i) => i.id === 'p0')?.draining, '…but the drain has begun')
  t.ok(warned.length > 0, 'the failed check is logged')
  const waited = d.wait('p0', 60_000)
  counting = true
  clock.advance(100)
  await tick()
  t.ok(registry.has('p0'), 'counted nothing left, but peer_gone failed: still there')
  peerGoneFails = false
  clock.advance(100)
  await tick()
  t.notOk(registry.has('p0'), 'the next poll retires it')
  t.same(await waited, { id: 'p0', drained: true, removed: true, inflight: 0, unreadLeases: 0 })
  t.equal(gone.length, 1)
})

t.test('closing with a drain unfinished: its waiters get where it stands', async (t) => {
  const { registry, drainer } = setup()
  registry.acquire('p0')
  await drainer.drain('p0')
  const waited = drainer.wait('p0', 60_000)
  drainer.close()
  t.same(await waited, { id: 'p0', drained: false, removed: false, inflight: 1, unreadLeases: 0 })
})
