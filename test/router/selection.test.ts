import t from 'tap'
import { seededRandom } from '../../common/random.js'
import type { InstanceView, TopologySnapshot } from '../../router/src/topology/views.js'
import { paired, pickLeastLoaded, selectDecoder, selectRoute } from '../../router/src/topology/selection.js'

function inst(id: string, role: InstanceView['role'], extra: Partial<InstanceView> = {}): InstanceView {
  return { id, role, source: 'config', url: `http://127.0.0.1/${id}`, labels: {}, engineIds: [], engineId: undefined, sharedRanks: false, healthy: true, draining: false, inflight: 0, limit: Number.POSITIVE_INFINITY, models: new Set(['m']), ...extra }
}

function snap(instances: InstanceView[]): TopologySnapshot {
  const models = new Set<string>()
  for (const i of instances) for (const m of i.models ?? []) models.add(m)
  return { instances, models }
}

const all = { mode: 'all' as const, label: 'transfer_group' }

t.test('a prefiller and a decoder make a P/D route', async (t) => {
  const r = selectRoute(snap([inst('p', 'prefill'), inst('d', 'decode')]), 'm', all, seededRandom(1))
  t.same(r && r.mode === 'pd' ? [r.prefill.id, r.decode.id] : r, ['p', 'd'])
})

t.test('without prefillers, or with only unhealthy ones, one instance serves in one leg', async (t) => {
  const noP = selectRoute(snap([inst('b', 'both')]), 'm', all, seededRandom(1))
  t.same(noP && noP.mode === 'single' ? noP.target.id : noP, 'b')
  const sickP = selectRoute(snap([inst('p', 'prefill', { healthy: false }), inst('d', 'decode')]), 'm', all, seededRandom(1))
  t.equal(sickP?.mode, 'single')
})

t.test('no decoder at all means no route', async (t) => {
  t.equal(selectRoute(snap([inst('p', 'prefill')]), 'm', all, seededRandom(1)), undefined)
  t.equal(selectRoute(snap([inst('d', 'decode', { healthy: false })]), 'm', all, seededRandom(1)), undefined)
})

t.test('instances that do not serve the model are skipped; unknown models are assumed served', async (t) => {
  const r = selectRoute(
    snap([inst('p', 'prefill', { models: new Set(['other']) }), inst('p2', 'prefill', { models: undefined }), inst('d', 'decode')]),
    'm',
    all,
    seededRandom(3),
  )
  t.equal(r?.mode === 'pd' ? r.prefill.id : undefined, 'p2')
})

t.test('label pairing keeps P and D in the same transfer group', async (t) => {
  const by = { mode: 'label' as const, label: 'transfer_group' }
  const a = inst('pa', 'prefill', { labels: { transfer_group: 'a' } })
  const db = inst('db', 'decode', { labels: { transfer_group: 'b' } })
  const da = inst('da', 'decode', { labels: { transfer_group: 'a' } })
  t.ok(paired(a, da, by))
  t.notOk(paired(a, db, by))
  t.ok(paired(a, db, all))
  for (let seed = 0; seed < 20; seed++) {
    const r = selectRoute(snap([a, db, da]), 'm', by, seededRandom(seed))
    t.equal(r?.mode === 'pd' ? r.decode.id : undefined, 'da')
  }
  // A prefiller with no decoder in its group is never chosen.
  const lonely = selectRoute(snap([inst('pc', 'prefill', { labels: { transfer_group: 'c' } }), db]), 'm', by, seededRandom(1))
  t.equal(lonely?.mode, 'single')
})

t.test('power of two choices prefers the less loaded of two', async (t) => {
  const busy = inst('busy', 'decode', { inflight: 10 })
  const idle = inst('idle', 'decode', { inflight: 0 })
  for (let seed = 0; seed < 20; seed++) t.equal(pickLeastLoaded([busy, idle], seededRandom(seed))?.id, 'idle')
  t.equal(pickLeastLoaded([], seededRandom(1)), undefined)
  // Over many draws every instance of three equally loaded ones is picked.
  const three = [inst('a', 'decode'), inst('b', 'decode'), inst('c', 'decode')]
  const seen = new Set<string>()
  const rnd = seededRandom(7)
  for (let i = 0; i < 100; i++) seen.add(pickLeastLoaded(three, rnd)?.id ?? '')
  t.same([...seen].sort(), ['a', 'b', 'c'])
})

t.test('capacity picks among healthy instances but never changes the mode', async (t) => {
  // Every instance here may hold 2 in flight.
  const at = (id: string, role: InstanceView['role'], extra: Partial<InstanceView> = {}): InstanceView => inst(id, role, { limit: 2, ...extra })
  const busyP = snap([at('p', 'prefill', { inflight: 2 }), at('d', 'decode')])
  t.same(selectRoute(busyP, 'm', all, seededRandom(1)), { mode: 'full', of: 'pd' }, 'a full prefiller queues; it does not fall back to a single leg')
  const busyD = snap([at('p', 'prefill'), at('d', 'decode', { inflight: 5 })])
  t.same(selectRoute(busyD, 'm', all, seededRandom(1)), { mode: 'full', of: 'pd' })
  const oneFree = selectRoute(snap([at('p', 'prefill'), at('d1', 'decode', { inflight: 2 }), at('d2', 'decode', { inflight: 1 })]), 'm', all, seededRandom(3))
  t.same(oneFree && oneFree.mode === 'pd' ? oneFree.decode.id : oneFree, 'd2', 'the decoder with room')
  t.same(selectRoute(snap([at('b', 'both', { inflight: 2 })]), 'm', all, seededRandom(1)), { mode: 'full', of: 'single' })
  t.equal(selectRoute(snap([at('b', 'both', { healthy: false })]), 'm', all, seededRandom(1)), undefined, 'no healthy instance is no route, not full')
  const own = selectRoute(snap([at('p', 'prefill'), at('d1', 'decode', { inflight: 2 }), at('d2', 'decode', { inflight: 2, limit: 3 })]), 'm', all, seededRandom(1))
  t.match(own, { mode: 'pd', decode: { id: 'd2' } }, 'each instance has its own limit: a raised one has room where another is full')
})

t.test('excluded instances are skipped (a retry after a refused connection)', async (t) => {
  const s = snap([inst('p1', 'prefill'), inst('p2', 'prefill'), inst('d', 'decode')])
  for (let seed = 0; seed < 10; seed++) {
    const r = selectRoute(s, 'm', all, seededRandom(seed), { exclude: new Set(['p1']) })
    t.equal(r && r.mode === 'pd' ? r.prefill.id : r, 'p2')
  }
  const only = selectRoute(snap([inst('p1', 'prefill'), inst('d', 'decode')]), 'm', all, seededRandom(1), { exclude: new Set(['p1']) })
  t.equal(only?.mode, 'single', 'with its only prefiller excluded the healthy decoder serves alone')
})

t.test('a resting pair (pair breaker) is one more filter: route around it, or serve locally', async (t) => {
  const s = snap([inst('p0', 'prefill'), inst('p1', 'prefill'), inst('d0', 'decode')])
  const blockP0 = (p: string, d: string): boolean => p === 'p0' && d === 'd0'
  for (let i = 0; i < 20; i++) {
    const r = selectRoute(s, 'm', all, seededRandom(i), { blocked: blockP0 })
    t.match(r, { mode: 'pd', prefill: { id: 'p1' }, decode: { id: 'd0' } })
  }
  const r = selectRoute(s, 'm', all, seededRandom(1), { blocked: () => true })
  t.match(r, { mode: 'single', target: { id: 'd0' } }, 'every pair resting: D prefills itself')
  t.equal(selectDecoder(s, s.instances[0] as InstanceView, 'm', all, seededRandom(1), { blocked: blockP0 }), undefined)
})
