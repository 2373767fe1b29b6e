import t from 'tap'
import { ManualClock } from '../../common/clock.js'
import { EngineEvents } from '../../transfer-agent/src/engine-events.js'
import { parsePrefillNotification, PrefillLeases } from '../../transfer-agent/src/prefill-leases.js'

function leases(clock: ManualClock, leaseMs = 5000) {
  const ended: { id: string; blocks: readonly number[]; reason: string }[] = []
  const table = new PrefillLeases({ clock, leaseMs, numBlocks: 8, onEnd: (id, blocks, reason) => ended.push({ id, blocks, reason }) })
  return { table, ended }
}

t.test('a lease exports its deadline on the agent clock and ends once, by read-done, release or expiry', async (t) => {
  const clock = new ManualClock({ monotonic: 12_000 })
  const { table, ended } = leases(clock)
  t.equal(table.lease('a', [0, 1]), 17, 'deadline in seconds on the monotonic clock (not wall time)')
  table.lease('b', [2])
  table.lease('c', [3])
  t.ok(table.readDone('a'))
  t.notOk(table.readDone('a'), 'a second read-done for an ended lease is ignored')
  t.ok(table.release('b'))
  clock.advance(5000)
  t.equal(table.reap(), 1)
  t.same(ended.map((e) => [e.id, e.reason]), [['a', 'read_done'], ['b', 'released'], ['c', 'expired']])
  t.same(ended[0]?.blocks, [0, 1])
  t.equal(table.size, 0)
  table.lease('d', [0, 1, 2, 3])
  t.pass('freed blocks can be leased again at once')
})

t.test('heartbeats extend to now + 2/3 of the lease, never shorten, and count unknown ids', async (t) => {
  const clock = new ManualClock({ monotonic: 0 })
  const { table, ended } = leases(clock, 6000)
  table.lease('a', [0])
  clock.advance(5000)
  t.same(table.heartbeat(['a', 'gone']), { extended: 1, unknown: 1 })
  clock.advance(3900)
  t.equal(table.reap(), 0, 'alive at 8.9 s: the heartbeat at 5 s extended it to 9 s')
  clock.advance(100)
  t.equal(table.reap(), 1)
  t.equal(ended[0]?.reason, 'expired')
})

t.test('bad leases are refused with coded errors', async (t) => {
  const clock = new ManualClock()
  const { table } = leases(clock)
  table.lease('a', [0, 1])
  t.throws(() => table.lease('a', [5]), { code: 'XFA_ERR_LEASE_EXISTS' })
  t.throws(() => table.lease('b', [1, 2]), { code: 'XFA_ERR_BLOCKS_LEASED' })
  t.throws(() => table.lease('c', [8]), { code: 'XFA_ERR_INVALID_ARG' })
  t.throws(() => table.lease('c', [-1]), { code: 'XFA_ERR_INVALID_ARG' })
  t.throws(() => table.lease('c', [4, 4]), { code: 'XFA_ERR_INVALID_ARG' })
  table.lease('c', [2, 3])
  t.equal(table.releaseAll(), 2)
  t.equal(table.size, 0)
})

t.test('notifications: HB: lists and <id>:<n> read-done messages', async (t) => {
  t.same(parsePrefillNotification('HB:a,b,c'), { kind: 'heartbeat', ids: ['a', 'b', 'c'] })
  t.same(parsePrefillNotification('cmpl-x-1234:1'), { kind: 'read_done', id: 'cmpl-x-1234' })
  t.same(parsePrefillNotification('GU:cmpl-x-1234'), { kind: 'gave_up', id: 'cmpl-x-1234' }, 'a decoder agent gave up a failed pull')
  t.equal(parsePrefillNotification('GU:'), undefined)
  t.same(parsePrefillNotification('id:with:colons:2'), { kind: 'read_done', id: 'id:with:colons' })
  t.equal(parsePrefillNotification('HB:'), undefined)
  t.equal(parsePrefillNotification('no-count'), undefined)
  t.equal(parsePrefillNotification(':1'), undefined)
  t.equal(parsePrefillNotification('x:one'), undefined)
})

t.test('engine events: ordered, dropped once acknowledged, long poll wakes on push or times out', async (t) => {
  const clock = new ManualClock()
  const events = new EngineEvents({ clock })
  events.push({ type: 'lease_ended', requestId: 'a', blockIds: [1], reason: 'read_done' })
  events.push({ type: 'pull_quiesced', requestId: 'b', blockIds: [2] })
  t.same((await events.poll(0, 0)).map((e) => e.seq), [1, 2])
  t.same((await events.poll(0, 0)).map((e) => e.seq), [1, 2], 'a lost answer is sent again')
  t.same(await events.poll(2, 0), [], 'acknowledged events are dropped')
  t.equal(events.pending, 0)

  const waiting = events.poll(2, 10_000)
  events.push({ type: 'pull_quiesced', requestId: 'c', blockIds: [3] })
  t.same((await waiting).map((e) => e.requestId), ['c'], 'a push wakes the poll')

  const idle = events.poll(3, 1000)
  clock.advance(1000)
  t.same(await idle, [], 'times out empty on the injected clock')

  const ac = new AbortController()
  const cut = events.poll(3, 60_000, ac.signal)
  ac.abort()
  t.same(await cut, [], 'the engine going away ends the poll')
})
