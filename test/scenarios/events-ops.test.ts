import t from 'tap'
import { freePort } from '../../common/ports.js'
import { get, post } from '../helpers/cluster.js'
import { admin, agentStatus, APPLY_BOUND_MS, cluster, delivered } from '../helpers/event-log.js'
import { complete, completionBody, metric, within } from '../helpers/pd-agents.js'
import { needNixl, probeNixl } from '../native/helpers.js'

/*
 * Issue 9, with real processes (one router in memory; a prefiller and a decoder whose transfer
 * agents follow its event log with --router-url; test/helpers/event-log.ts):
 * a. ops `POST /fault_tolerance/event` peer_gone for the prefiller → every agent applies it
 *    within APPLY_BOUND_MS and the decoder releases its state; a repeat, an unknown engine, a
 *    bad body and a missing token change nothing. The prefiller is alive and still in routing,
 *    so its next answer makes it peer_alive (issue 17 item 6) and P/D goes on; a pull racing
 *    that fails fast (XFA_ERR_PEER_GONE).
 */

const probe = await probeNixl()

t.test('a. ops peer_gone: every agent applies it, the decoder releases the peer, repeats and unknowns are no-ops; a live engine lives again', { skip: needNixl(t, probe) }, async (t) => {
  // The decoder's agent is given a dead router first: it fails over to the live one.
  const deadPort = await freePort()
  const { prefill, decode, router } = await cluster(t, await freePort(), (url) => `http://127.0.0.1:${deadPort},${url}`)
  const first = await complete(router.url, completionBody(0, 'a'), 0)
  t.ok(first.ok, `a request works before (${first.status} ${first.code ?? ''})`)
  const p = await agentStatus(prefill)
  const d = await agentStatus(decode)

  const url = `${router.url}/fault_tolerance/event`
  const event = { event_type: 'peer_gone', nodes: { engine_ids: [p.engineId] }, reason: 'scenario a' }
  let res = await post(url, event)
  t.equal(res.status, 401, 'no token: 401')
  t.equal(res.json<{ error: { code: string } }>().error.code, 'RTR_ERR_ADMIN_UNAUTHORIZED')
  res = await post(url, { event_type: 'peer_gone', nodes: { engine_ids: 'x' } }, admin)
  t.equal(res.status, 400, 'bad body: 400')
  res = await post(url, { event_type: 'peer_gone', nodes: { engine_ids: ['no-such-engine'] } }, admin)
  const logId = res.json<{ log_id: string }>().log_id
  t.same(res.json(), { seq: null, log_id: logId, engine_ids: [], unknown: ['no-such-engine'], alive_skipped: [], logged: false }, 'unknown engine: a no-op')

  res = await post(url, event, admin)
  t.equal(res.status, 202)
  const { seq, logged } = res.json<{ seq: number; logged: boolean }>()
  t.ok(logged)
  const ms = await within(APPLY_BOUND_MS, () => delivered(router.url, seq, [p.agentId, d.agentId]))
  t.ok(ms >= 0, `every agent applied peer_gone #${seq} within ${APPLY_BOUND_MS} ms (took ${Math.round(ms)} ms)`)
  t.comment(`ops peer_gone → applied by both agents in ${Math.round(ms)} ms`)
  t.match((await get(`${router.url}/fault_tolerance/events/${seq}`, admin)).json(), { complete: true })
  t.ok((await metric(decode.agent.url, 'handoff_agent_router_events_total', { type: 'peer_gone' })) >= 1, "counted in the decoder agent's metrics")
  t.equal(await metric(decode.agent.url, 'handoff_agent_router_connected'), 1)

  res = await post(url, event, admin)
  t.same(res.json(), { seq, log_id: logId, engine_ids: [p.engineId], unknown: [], alive_skipped: [], logged: false }, 'a repeat: the same seq, nothing logged')

  // The decoder dropped P's state at once. P is still in routing, and alive: its next prefill
  // answer names its engine_id, the router logs peer_alive, the agents lift the tombstone and
  // P/D goes on (issue 17 item 6). A pull racing that event may still fail fast, coded.
  t.ok((await metric(decode.agent.url, 'handoff_agent_peer_releases_total', { reason: 'peer_gone' })) >= 1, "the decoder released P's state")
  const afters: Awaited<ReturnType<typeof complete>>[] = []
  for (let i = 0; i < 3; i++) afters.push(await complete(router.url, completionBody(1 + i, 'a'), 1 + i))
  const failed = afters.filter((o) => o.status !== 200)
  t.ok(failed.every((o) => /XFA_ERR_PEER_GONE/.test(o.message ?? '')), `a pull that raced the lift failed fast with XFA_ERR_PEER_GONE (${failed.length})`)
  t.ok(afters.at(-1)?.ok, 'and then P/D serves again')
  t.ok((await metric(router.url, 'handoff_router_events_total', { type: 'peer_alive' })) >= 1, 'the router logged peer_alive: a live engine declared gone lives again')
})
