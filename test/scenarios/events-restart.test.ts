import t from 'tap'
import { freePort } from '../../common/ports.js'
import { post } from '../helpers/cluster.js'
import { admin, agentStatus, APPLY_BOUND_MS, cluster, delivered, ghost } from '../helpers/event-log.js'
import { complete, completionBody, sleep, tally, within, type Outcome } from '../helpers/pd-agents.js'
import { needNixl, probeNixl } from '../native/helpers.js'

/*
 * Issue 9, with real processes (test/helpers/event-log.ts):
 * c. the router restarts under traffic: agents register again and resume; its log is in
 *    memory and starts at 1 again, below what the agents applied, so they apply it from its
 *    start; an event logged after the restart reaches every agent.
 */

const probe = await probeNixl()

t.test('c. a router restart under traffic: agents register again, resume, and apply the new log from its start', { skip: needNixl(t, probe) }, async (t) => {
  const port = await freePort()
  const { prefill, decode, router, restart } = await cluster(t, port)
  const agents = [await agentStatus(prefill), await agentStatus(decode)]
  const ids = agents.map((a) => a.agentId)
  // Two events before the restart (about engines only the router knows: traffic is not hurt).
  for (const n of [1, 2]) {
    await ghost(router.url, `${n}`, 41010 + n)
    await post(`${router.url}/fault_tolerance/event`, { event_type: 'peer_gone', nodes: { engine_ids: [`ghost-${n}`] } }, admin)
  }
  t.ok((await within(APPLY_BOUND_MS, () => delivered(router.url, 2, ids))) >= 0, 'both agents applied #1 and #2')
  const oldRouterId = (await agentStatus(decode)).router.routerId

  let running = true
  const outcomes: Outcome[] = []
  const loops = [0, 1].map(async (w) => {
    for (let i = w; running; i += 2) {
      outcomes.push(await complete(router.url, completionBody(i, 'c'), i, 20_000))
      await sleep(20)
    }
  })
  await sleep(500)
  const stopStarted = performance.now()
  await router.stop()
  t.ok(performance.now() - stopStarted < 3000, `the router stopped in ${Math.round(performance.now() - stopStarted)} ms with agent streams open`)
  await sleep(300)
  const router2 = await restart()
  t.equal(router2.url, router.url, 'the new router serves at the same URL')
  const back = await within(5000, async () => {
    const s = await Promise.all([prefill, decode].map(agentStatus))
    return s.every((x) => x.router.connected && x.router.routerId !== oldRouterId)
  })
  t.ok(back >= 0, `both agents registered with the new router and resumed (${Math.round(back)} ms after it was ready)`)
  for (const a of [prefill, decode]) t.equal((await agentStatus(a)).router.lastApplied, 0, 'the new log is applied from its start')
  await sleep(1000)
  running = false
  await Promise.all(loops)
  const c = tally(outcomes)
  t.comment(`traffic across the restart: ${c.requests} requests, ${c.ok} ok, ${c.failed} failed ${JSON.stringify(c.codes)}`)
  t.equal(c.wrong, 0, 'no wrong text')
  t.ok(outcomes.slice(-2).every((o) => o.ok), 'traffic flows again after the restart')

  await ghost(router2.url, '3', 41013)
  const res = await post(`${router2.url}/fault_tolerance/event`, { event_type: 'peer_gone', nodes: { engine_ids: ['ghost-3'] } }, admin)
  const { seq } = res.json<{ seq: number }>()
  t.equal(seq, 1, 'the new log starts at 1, below the 2 the agents had applied')
  const ms = await within(APPLY_BOUND_MS, () => delivered(router2.url, seq, ids))
  t.ok(ms >= 0, `every agent applied the event logged after the restart (${Math.round(ms)} ms)`)
  // What the old router knew is gone with it: a repeat of its events is unknown here.
  const repeat = await post(`${router2.url}/fault_tolerance/event`, { event_type: 'peer_gone', nodes: { engine_ids: ['ghost-1'] } }, admin)
  t.same(repeat.json<{ unknown: string[] }>().unknown, ['ghost-1'], 'the old log (and its gone set) did not survive the restart (in-memory store)')
})
