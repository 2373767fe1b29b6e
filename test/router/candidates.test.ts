import t from 'tap'
import { ManualClock } from '../../common/clock.js'
import { seededRandom } from '../../common/random.js'
import type { InstanceRole } from '../../schemas/router-config.js'
import { TopologyRegistry } from '../../router/src/topology/registry.js'
import type { InstanceView } from '../../router/src/topology/views.js'
import { paired, selectRoute, type PairingPolicy, type Selection } from '../../router/src/topology/selection.js'

// Issue 23 item 3: the registry's candidate lists (topology/candidates.ts) answer what
// `selectRoute` answers over a snapshot, without the O(instances) scan. Differential: random
// topologies driven through the registry's own API (probes, ejections that expire with time,
// drains, slots taken and given back, removals), and after every step the fast answer must be
// one the scan could give: the same mode, and instances the scan would accept.

const POLICY = { unhealthyThreshold: 1, baseEjectionMs: 50, maxEjectionMs: 200 }
const CAP = 3
const ROLES: InstanceRole[] = ['prefill', 'decode', 'both']
const MODEL_SETS: (string[] | undefined)[] = [undefined, ['m'], ['m', 'x']]

/** Whether `sel` is an answer `selectRoute` could give for this snapshot (its rules, restated). */
function valid(sel: Selection | undefined, expected: Selection | undefined, pairing: PairingPolicy): string | undefined {
  if (expected === undefined || sel === undefined) return expected === sel ? undefined : `expected ${JSON.stringify(expected)}, got ${JSON.stringify(sel)}`
  if (sel.mode !== expected.mode) return `mode ${sel.mode}, scan says ${expected.mode}`
  if (sel.mode === 'full') return sel.of === (expected as { of: string }).of ? undefined : 'full of another mode'
  const usable = (i: InstanceView): boolean => i.healthy && i.inflight < i.limit && (i.models === undefined || i.models.has('m'))
  if (sel.mode === 'single') return usable(sel.target) && sel.target.role !== 'prefill' ? undefined : `bad single target ${sel.target.id}`
  if (sel.prefill.role !== 'prefill' || !usable(sel.prefill)) return `bad prefiller ${sel.prefill.id}`
  if (sel.decode.role === 'prefill' || !usable(sel.decode)) return `bad decoder ${sel.decode.id}`
  return paired(sel.prefill, sel.decode, pairing) ? undefined : `unpaired ${sel.prefill.id} ${sel.decode.id}`
}

for (const pairing of [
  { mode: 'all', label: 'transfer_group' },
  { mode: 'label', label: 'transfer_group' },
] as PairingPolicy[]) {
  t.test(`pairing ${pairing.mode}: the candidate lists answer as the scan does, through 3,000 random steps`, async (t) => {
    const random = seededRandom(pairing.mode === 'all' ? 7 : 11)
    const draw = (n: number): number => Math.floor(random.next() * n)
    const clock = new ManualClock()
    const registry = new TopologyRegistry({ clock, policy: POLICY, instances: [], pairing, limit: CAP })
    let next = 0
    let fast = 0
    const problems: string[] = []
    for (let step = 0; step < 3000 && problems.length === 0; step++) {
      const ids = registry.ids()
      const id = ids[draw(ids.length)]
      const op = ids.length < 3 ? 0 : draw(10)
      // Now and then an engine without the model: while it is eligible the lists defer to the scan.
      if (step % 1000 === 999 && id) registry.recordProbe(id, true, ['x'])
      if (op === 0 && ids.length < 24) registry.add({ id: `i${next++}`, role: ROLES[draw(3)] as InstanceRole, url: `http://10.0.0.${next}:8000`, labels: { transfer_group: `g${draw(3)}` } })
      else if (op === 1 && id) registry.recordProbe(id, random.next() < 0.7, MODEL_SETS[draw(MODEL_SETS.length)])
      else if (op === 2 && id) registry.recordFailure(id)
      else if (op === 3 && id && random.next() < 0.2) registry.drain(id)
      else if (op === 4 && id && random.next() < 0.3) registry.remove(id)
      else if (op === 5 && id) registry.acquire(id)
      else if (op === 6 && id) registry.release(id)
      // Admission moves one instance's limit (adaptive-limits.ts); the lists re-file it.
      else if (op === 7 && id && random.next() < 0.3) registry.setLimit(id, 1 + draw(CAP + 1))
      else clock.advance(draw(60))
      const expected = selectRoute(registry.snapshot(), 'm', pairing, seededRandom(step))
      const got = registry.select('m', seededRandom(step))
      const why = valid(got, expected, pairing)
      if (why) problems.push(`step ${step}: ${why}; topology ${JSON.stringify(registry.snapshot().instances.map((i) => [i.id, i.role, i.labels.transfer_group, i.healthy, i.inflight, i.models && [...i.models]]))}`)
      if (got && got.mode !== 'full') fast++
    }
    t.same(problems, [], 'every answer is one the scan could give')
    t.ok(fast > 300, `and routes were found along the way (${fast})`)
    t.ok(registry.selectionScans < 1500, `most answers came from the lists (${3000 - registry.selectionScans} of 3000; the rest deferred to the scan)`)
    t.ok(registry.selectionScans > 0, 'and the scan still answers what they cannot (an eligible instance without the model)')
  })
}

t.test('an ejection that expires makes the instance a candidate again, with no event', async (t) => {
  const clock = new ManualClock()
  const registry = new TopologyRegistry({
    clock,
    policy: { unhealthyThreshold: 1, baseEjectionMs: 1000, maxEjectionMs: 1000 },
    instances: [{ id: 'd', role: 'decode', url: 'http://127.0.0.1:1' }],
    limit: 4,
  })
  const random = seededRandom(1)
  t.match(registry.select('m', random), { mode: 'single', target: { id: 'd' } })
  registry.recordFailure('d')
  t.equal(registry.select('m', random), undefined, 'ejected: no route')
  clock.advance(1000)
  t.match(registry.select('m', random), { mode: 'single', target: { id: 'd' } }, 'the ejection ran out: routed again')
})

t.test('at its limit an instance leaves the open list, and a slot given back returns it', async (t) => {
  const registry = new TopologyRegistry({
    clock: new ManualClock(),
    policy: POLICY,
    instances: [
      { id: 'p', role: 'prefill', url: 'http://127.0.0.1:1' },
      { id: 'd', role: 'decode', url: 'http://127.0.0.1:2' },
    ],
    limit: 1,
  })
  const random = seededRandom(1)
  t.match(registry.select('m', random), { mode: 'pd', prefill: { id: 'p' }, decode: { id: 'd' } })
  registry.acquire('d')
  t.same(registry.select('m', random), { mode: 'full', of: 'pd' }, 'the decoder is full: the pair waits, it is not served locally')
  registry.release('d')
  t.match(registry.select('m', random), { mode: 'pd' })
  t.match(registry.selectDecoder(registry.snapshot().instances.find((i) => i.id === 'p') as InstanceView, 'm', random), { id: 'd' })
  registry.remove('d')
  t.equal(registry.select('m', random), undefined, 'no decoder left: no route')
  t.notOk(registry.unknownModel('m'), 'no instance listed models: any model may be served')
  registry.add({ id: 'd2', role: 'decode', url: 'http://127.0.0.1:3' })
  registry.recordProbe('d2', true, ['m'])
  t.ok(registry.unknownModel('other') && !registry.unknownModel('m'), 'once they did, the others are unknown')
})
