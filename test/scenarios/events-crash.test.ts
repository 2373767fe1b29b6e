import t from 'tap'
import { freePort } from '../../common/ports.js'
import { get } from '../helpers/cluster.js'
import { admin, agentStatus, APPLY_BOUND_MS, cluster } from '../helpers/event-log.js'
import { complete, completionBody, tally, within, type Outcome } from '../helpers/pd-agents.js'
import { needNixl, probeNixl } from '../native/helpers.js'

/*
 * Issue 9, with real processes (test/helpers/event-log.ts):
 * b. the prefiller crashes (SIGKILL): its probes fail and its agent's stream is gone, so the
 *    router emits peer_gone for its engine_id, and the decoder's agent applies it within
 *    APPLY_BOUND_MS of the kill; it comes back at the same ports under a new engine_id and
 *    every later request succeeds.
 */

const probe = await probeNixl()

t.test('b. a prefiller crash: peer_gone for its old engine_id reaches the decoder agent', { skip: needNixl(t, probe) }, async (t) => {
  const { prefill, decode, router } = await cluster(t, await freePort())
  t.ok((await complete(router.url, completionBody(0, 'b'), 0)).ok, 'a request works before')
  const old = await agentStatus(prefill)
  const d = await agentStatus(decode)
  const appliedBefore = d.router.lastApplied

  // The crash itself is the signal: probes fail and the agent's stream is gone.
  await prefill.kill()
  const killedAt = performance.now()
  let seq = 0
  const ms = await within(APPLY_BOUND_MS, async () => {
    const s = (await agentStatus(decode)).router
    if (s.lastApplied <= appliedBefore) return false
    seq = s.lastApplied
    return true
  })
  const total = performance.now() - killedAt
  t.ok(ms >= 0, `the decoder's agent applied peer_gone within ${APPLY_BOUND_MS} ms of the kill (${Math.round(total)} ms; probes every 100 ms, threshold 1)`)
  t.comment(`prefiller crash (SIGKILL) → peer_gone applied by the decoder's agent ${Math.round(total)} ms later`)
  // The agent acknowledges what it applied right after applying it, on a call of its own.
  type Delivery = { type: string; expected: string[]; applied: string[] }
  let delivery = (await get(`${router.url}/fault_tolerance/events/${seq}`, admin)).json<Delivery>()
  await within(5000, async () => {
    delivery = (await get(`${router.url}/fault_tolerance/events/${seq}`, admin)).json<Delivery>()
    return delivery.applied.length > 0
  })
  t.equal(delivery.type, 'peer_gone')
  t.same(delivery.expected, [d.agentId], 'expected: the live decoder agent only (the dead agent left the directory)')
  t.same(delivery.applied, [d.agentId])

  await prefill.startAgent()
  await prefill.startSim()
  const now = await agentStatus(prefill)
  t.not(now.engineId, old.engineId, 'the prefiller came back under a new engine_id')

  // The old engine_id is gone at the decoder; the new one at the same address is not.
  const ok = await within(15_000, async () => (await complete(router.url, completionBody(1, 'b'), 1)).ok)
  t.ok(ok >= 0, 'requests succeed through the restarted prefiller')
  const outcomes: Outcome[] = []
  for (let i = 2; i < 6; i++) outcomes.push(await complete(router.url, completionBody(i, 'b'), i))
  t.equal(tally(outcomes).ok, 4, 'every later request succeeds with the oracle text')
})
