import t from 'tap'
import { ManualClock } from '../../common/clock.js'
import { AgentDirectory } from '../../router/src/events/agent-directory.js'
import type { AgentRegistration } from '../../schemas/events.js'

/*
 * Issue 37 item 4: a transfer agent's registration made its instance's reads trusted for
 * ever, with no stream open: once a stock engine that checks nothing served at that URL, the
 * router passed its late reads on. The directory trusts only a live agent: its stream open,
 * or within trustMs of when it was last known connected (on the injected clock).
 */

const reg = (kind: AgentRegistration['kind'] = 'transfer-agent'): AgentRegistration => ({
  agentId: 'a1',
  engineId: 'e1',
  role: 'decode',
  agentUrl: 'http://127.0.0.1:7001',
  engineUrl: 'http://127.0.0.1:8001',
  kind,
})

t.test('a registration alone is trusted for trustMs, then no longer', async (t) => {
  const clock = new ManualClock()
  const dir = new AgentDirectory({ clock, trustMs: 15_000 })
  dir.register(reg(), 'd0')
  t.ok(dir.checksReads('d0'), 'just registered: its agent checks reads')
  t.notOk(dir.checksReads('d1'), 'another instance: no agent')
  clock.advance(15_000)
  t.ok(dir.checksReads('d0'), 'at the bound: still')
  clock.advance(1)
  t.notOk(dir.checksReads('d0'), 'past it, with no stream ever opened: checked as stock')
})

t.test('an open stream is trusted however long; a closed one for trustMs after it closed', async (t) => {
  const clock = new ManualClock()
  const dir = new AgentDirectory({ clock, trustMs: 15_000 })
  dir.register(reg(), 'd0')
  dir.streamOpened('a1')
  clock.advance(3_600_000)
  t.ok(dir.checksReads('d0'), 'an hour with its stream open')
  dir.streamClosed('a1')
  clock.advance(15_000)
  t.ok(dir.checksReads('d0'), 'reconnecting: still trusted')
  clock.advance(1)
  t.notOk(dir.checksReads('d0'), 'gone for longer: checked as stock')
  dir.streamOpened('a1')
  t.ok(dir.checksReads('d0'), 'back: trusted again')
})

t.test('a vLLM connector is never trusted: it checks no read', async (t) => {
  const dir = new AgentDirectory({ clock: new ManualClock() })
  dir.register(reg('vllm-connector'), 'd0')
  dir.streamOpened('a1')
  t.notOk(dir.checksReads('d0'))
})

t.test('several routers: a record written elsewhere is trusted while the router holding its stream refreshes it', async (t) => {
  const clock = new ManualClock()
  const holder = new AgentDirectory({ clock, trustMs: 15_000 })
  const other = new AgentDirectory({ clock, trustMs: 15_000 })
  // What SharedTopology does: every record the holder writes reaches the other router.
  holder.subscribe((_id, record) => record && other.put(record))
  holder.register(reg(), 'd0')
  holder.streamOpened('a1')
  for (let i = 0; i < 12; i++) {
    clock.advance(5_000)
    holder.refreshConnected()
  }
  t.ok(other.checksReads('d0'), 'a minute on: the holder kept its record fresh')
  t.equal(other.get('a1')?.streams, 0, 'the other router holds no stream of it')
  clock.advance(15_001)
  t.notOk(other.checksReads('d0'), 'no refresh for longer than trustMs (the holder died): checked as stock')
})
