import t from 'tap'
import type { SpawnedService } from '../../common/spawn.js'
import { post } from '../helpers/cluster.js'
import { complete, completionBody, sleep, tally, within, type Outcome } from '../helpers/pd-agents.js'
import { admin, agentStatus, delivered, ghost } from '../helpers/event-log.js'
import { fleet } from '../helpers/routers.js'
import { needRedis } from '../helpers/redis.js'
import { needNixl, probeNixl } from '../native/helpers.js'

/*
 * Issue 10, several routers on one Redis, with real processes (test/helpers/routers.ts):
 * b. a router SIGKILLed under load: its requests fail cleanly (none hangs), the other keeps
 * answering, its agents resume on the other router after their last sequence, and an
 * event logged while they were away reaches them.
 */

const probe = await probeNixl()

t.test('b. a router SIGKILLed under load: clean failures, the other serves, agents resume with nothing lost', { skip: needRedis(t) || needNixl(t, probe) }, async (t) => {
  // Both agents stream from router 0, the one that dies.
  const { prefill, decode, routers } = await fleet(t, [0, 1])
  const [a, b] = routers as [SpawnedService, SpawnedService]
  const before = await Promise.all([prefill, decode].map(agentStatus))
  const logId = before[0]?.router.routerId

  let stop = false
  const onA: Outcome[] = []
  const onB: Outcome[] = []
  const afterKill: { startedAt: number; out: Outcome }[] = []
  let killedAt = Number.POSITIVE_INFINITY
  const client = async (url: string, sink: Outcome[], n: number): Promise<void> => {
    for (let i = 0; !stop; i++) {
      const startedAt = performance.now()
      const out = await complete(url, completionBody(n * 1000 + i, 'kill', 8), n * 1000 + i, 20_000)
      sink.push(out)
      if (url === b.url && startedAt > killedAt) afterKill.push({ startedAt: startedAt - killedAt, out })
      if (!out.ok) await sleep(50)
    }
  }
  const clients = [0, 1, 2].map((n) => client(a.url, onA, n)).concat([3, 4].map((n) => client(b.url, onB, n)))
  await sleep(1500)
  // A router replica crashes: its requests in flight die with it.
  a.child.kill('SIGKILL')
  killedAt = performance.now()
  // Logged while the agents are between routers: they must still get it.
  await ghost(b.url, 'b', 41002)
  const ft = await post(`${b.url}/fault_tolerance/event`, { event_type: 'peer_gone', nodes: { engine_ids: ['ghost-b'] } }, admin)
  t.equal(ft.status, 202, 'the survivor takes control writes')
  const seq = ft.json<{ seq: number }>().seq
  await sleep(2500)
  stop = true
  await Promise.all(clients)

  const ta = tally(onA)
  const tb = tally(onB)
  t.comment(`router 0 (killed): ${JSON.stringify(ta)}; router 1: ${JSON.stringify(tb)}`)
  t.equal(tb.wrong, 0, 'router 1: no wrong text')
  t.equal(ta.wrong, 0, 'router 0: no wrong text')
  t.ok(onA.every((o) => o.ok || o.status === 0 || o.status >= 500), "router 0's failures are connection errors or coded 5xx, and none hung (each bounded)")
  const late = afterKill.filter((x) => x.startedAt <= 2000)
  t.ok(late.length > 0 && late.every((x) => x.out.ok), `requests to router 1 started in the 2 s after the kill succeed (${late.filter((x) => x.out.ok).length}/${late.length})`)

  const agents = [prefill, decode]
  const resumed = await within(10_000, async () => (await Promise.all(agents.map(agentStatus))).every((s) => s.router.connected && s.router.lastApplied >= seq))
  t.ok(resumed >= 0, `both agents resumed on router 1 and applied seq ${seq} logged while they were away (${Math.round(resumed)} ms after the load)`)
  const after = await Promise.all(agents.map(agentStatus))
  t.ok(
    after.every((s, i) => s.router.routerId === logId && s.router.lastApplied >= (before[i]?.router.lastApplied ?? 0)),
    'the same log: they resumed after their last sequence instead of starting over',
  )
  t.ok(await within(3000, () => delivered(b.url, seq, after.map((s) => s.agentId))) >= 0, 'router 1 records both acknowledgements')
  const out = await complete(b.url, completionBody(9999, 'after'), 9999)
  t.ok(out.ok, 'and P/D requests through router 1 still work')
})
