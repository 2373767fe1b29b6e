import t from 'tap'
import { ManualClock } from '../../common/clock.js'
import { HeartbeatRegistry } from '../../transfer-agent/src/heartbeats.js'

t.test('a record keeps first and last send, the largest gap and any failure', async (t) => {
  const clock = new ManualClock({ monotonic: 1_000 })
  const hb = new HeartbeatRegistry({ clock })
  const rec = hb.start('p0', 'r1')
  t.match(rec, { engineId: 'p0', requestId: 'r1', startedAt: 1_000, firstSentAt: undefined, lastSentAt: undefined, maxGapMs: 0, sends: 0, failed: false })
  t.throws(() => hb.start('p0', 'r1'), /already started/)

  clock.advance(200)
  hb.sent('p0', 'r1', true)
  t.match(hb.get('p0', 'r1'), { firstSentAt: 1_200, lastSentAt: 1_200, maxGapMs: 0, sends: 1, failed: false })
  clock.advance(5_000)
  hb.sent('p0', 'r1', true)
  clock.advance(7_000)
  hb.sent('p0', 'r1', true)
  clock.advance(4_000)
  hb.sent('p0', 'r1', true)
  t.match(hb.get('p0', 'r1'), { firstSentAt: 1_200, lastSentAt: 17_200, maxGapMs: 7_000, sends: 4, failed: false })

  // One failed send breaks the chain for good, even if later sends work.
  clock.advance(1_000)
  hb.sent('p0', 'r1', false)
  clock.advance(1_000)
  hb.sent('p0', 'r1', true)
  t.match(hb.get('p0', 'r1'), { lastSentAt: 19_200, sends: 6, failed: true })
})

t.test('records are keyed by (engine, request) and grouped per engine for one HB: message', async (t) => {
  const clock = new ManualClock()
  const hb = new HeartbeatRegistry({ clock })
  hb.start('p0', 'a')
  hb.start('p0', 'b')
  hb.start('p1', 'a')
  t.equal(hb.size, 3)
  t.same(hb.engines(), ['p0', 'p1'])
  t.same(hb.requestIds('p0'), ['a', 'b'])
  t.same(hb.requestIds('nobody'), [])
  clock.advance(10)
  for (const id of hb.requestIds('p0')) hb.sent('p0', id, true)
  t.equal(hb.get('p0', 'a')?.sends, 1)
  t.equal(hb.get('p1', 'a')?.sends, 0, 'same request id on another engine is another record')
  t.equal(hb.sent('p9', 'a', true), undefined, 'untracked pull')
})

t.test('the record is dropped when the pull finishes or fails', async (t) => {
  const clock = new ManualClock()
  const hb = new HeartbeatRegistry({ clock })
  hb.start('p0', 'done')
  hb.start('p0', 'failed')
  hb.sent('p0', 'done', true)
  hb.sent('p0', 'failed', false)

  t.ok(hb.end('p0', 'done'), 'pull finished')
  t.equal(hb.get('p0', 'done'), undefined)
  t.same(hb.requestIds('p0'), ['failed'])
  t.ok(hb.end('p0', 'failed'), 'pull failed')
  t.equal(hb.size, 0)
  t.same(hb.engines(), [], 'an engine with no pulls gets no HB: message')
  t.notOk(hb.end('p0', 'done'), 'ending twice is a no-op')
  t.equal(hb.sent('p0', 'done', true), undefined, 'a late heartbeat tick for an ended pull is ignored')
  // The same pair can be tracked again (a retried pull) from a fresh record.
  clock.advance(50)
  t.match(hb.start('p0', 'done'), { startedAt: 50, sends: 0, failed: false })
})
