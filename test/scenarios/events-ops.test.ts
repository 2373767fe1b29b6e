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
 *    within APPLY_BOUND_MS; the decoder's next pull from it fails fast (XFA_ERR_PEER_GONE); a
 *    repeat, an unknown engine, a bad body and a missing token change nothing.
 */

const probe = await probeNixl()

t.test('a. ops peer_gone: every agent applies it, the decoder fails fast, repeats and unknowns are no-ops', { skip: needNixl(t, probe) }, async (t) => {
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
  t.same(res.json(), { seq: null, engine_ids: [], unknown: ['no-such-engine'], alive_skipped: [], logged: false }, 'unknown engine: a no-op')

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
  t.same(res.json(), { seq, engine_ids: [p.engineId], unknown: [], alive_skipped: [], logged: false }, 'a repeat: the same seq, nothing logged')

  // D's next pull naming P fails fast: the request fails with the agent's code in its message.
  const started = performance.now()
  const after = await complete(router.url, completionBody(1, 'a'), 1)
  const took = performance.now() - started
  t.not(after.status, 200, 'the request through the gone prefiller fails')
  t.match(after.message ?? '', /XFA_ERR_PEER_GONE/, `with XFA_ERR_PEER_GONE (${after.code}: ${after.message?.slice(0, 160)})`)
  t.ok(took < 5000, `and fast (${Math.round(took)} ms)`)
})
