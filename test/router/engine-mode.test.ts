import Fastify from 'fastify'
import t, { type Test } from 'tap'
import { get, post, startRouter, waitFor } from '../helpers/cluster.js'

/*
 * Engine mode: engines without a transfer agent are told about peer_gone by the router
 * itself (vLLM's proposed POST /drop_peer, PR #56341). The engines here are small fastify
 * servers standing in for stock vLLM, which cannot run on this machine; they record the calls.
 */
const ADMIN = 'admin-token-123'
const auth = { authorization: `Bearer ${ADMIN}` }

async function stockEngine(t: Test, failFirst = 0): Promise<{ url: string; calls: unknown[] }> {
  const calls: unknown[] = []
  let failures = failFirst
  const app = Fastify()
  app.get('/health', async () => ({}))
  app.get('/v1/models', async () => ({ object: 'list', data: [{ id: 'handoff/sim-1', object: 'model' }] }))
  app.post('/drop_peer', async (req, reply) => {
    if (failures-- > 0) return reply.code(503).send({ error: 'busy' })
    calls.push(req.body)
    return { ok: true }
  })
  const url = await app.listen({ host: '127.0.0.1', port: 0 })
  t.teardown(() => app.close())
  return { url, calls }
}

t.test('peer_gone reaches engines without an agent through the URL template, with retries', async (t) => {
  const agentMode = await stockEngine(t)
  const plain = await stockEngine(t)
  const flaky = await stockEngine(t, 2)
  const { url } = await startRouter(
    t,
    [
      { id: 'p0', role: 'prefill', url: agentMode.url },
      { id: 'd0', role: 'decode', url: plain.url },
      { id: 'd1', role: 'decode', url: flaky.url },
    ],
    { adminToken: ADMIN, engineMode: { peerGoneUrl: '{instance_url}/drop_peer', retries: 3, timeoutMs: 1000, backoffMs: 20 } },
  )
  // p0 runs an agent (agent mode): it learns peer_gone from its stream, not from a call.
  t.equal((await post(`${url}/v1/agents`, { agentId: 'a-p0', engineId: 'eng-p0', role: 'prefill', agentUrl: 'http://127.0.0.1:7700', engineUrl: agentMode.url })).status, 200)
  const res = await post(`${url}/fault_tolerance/event`, { event_type: 'peer_gone', nodes: { engine_ids: ['eng-p0'] }, reason: 'test' }, auth)
  t.equal(res.status, 202)
  t.ok(await waitFor(() => plain.calls.length === 1 && flaky.calls.length === 1, 5000), 'both engines without an agent were called')
  t.same(plain.calls, [{ engine_id: 'eng-p0' }])
  t.same(flaky.calls, [{ engine_id: 'eng-p0' }], 'the flaky one after two 503s')
  t.same(agentMode.calls, [], 'the engine with an agent (and the gone engine itself) is not called')
  const metrics = (await get(`${url}/metrics`)).text
  t.match(metrics, /handoff_router_engine_notifications_total\{outcome="ok"\} 2/)
})

t.test('without a template nothing is called and the skipped notifications are counted', async (t) => {
  const a = await stockEngine(t)
  const b = await stockEngine(t)
  const { url } = await startRouter(t, [{ id: 'p0', role: 'prefill', url: a.url }, { id: 'd0', role: 'decode', url: b.url }], { adminToken: ADMIN })
  await post(`${url}/v1/agents`, { agentId: 'a-p0', engineId: 'eng-p0', role: 'prefill', agentUrl: 'http://127.0.0.1:7701', engineUrl: a.url })
  t.equal((await post(`${url}/fault_tolerance/event`, { event_type: 'peer_gone', nodes: { engine_ids: ['eng-p0'] } }, auth)).status, 202)
  t.match((await get(`${url}/metrics`)).text, /handoff_router_engine_notifications_total\{outcome="not_configured"\} 1/)
  t.same(b.calls, [])
})
