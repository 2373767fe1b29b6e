import t from 'tap'
import { createSystemRandom, seededRandom } from '../../common/random.js'

t.test('system ids: the asked length, lowercase hex, no repeats across pool refills', async (t) => {
  const r = createSystemRandom(64)
  const seen = new Set<string>()
  for (let i = 0; i < 200; i++) {
    const id = r.hex(12)
    t.match(id, /^[0-9a-f]{24}$/)
    seen.add(id)
  }
  t.equal(seen.size, 200)
  t.match(r.hex(100), /^[0-9a-f]{200}$/, 'more than a pool holds')
  const x = r.next()
  t.ok(x >= 0 && x < 1)
})

t.test('seeded randomness repeats itself', async (t) => {
  t.same([seededRandom(7).next(), seededRandom(7).hex(4)], [seededRandom(7).next(), seededRandom(7).hex(4)])
})
