import t from 'tap'
import { request } from 'undici'
import { post, startRouter, startSim } from '../helpers/cluster.js'

const ADMIN = 'admin-token-123'

t.test('a graceful close waits (bounded) for connected agents to acknowledge what was logged', async (t) => {
  const sim = await startSim(t, ['--role', 'decode'])
  const { app, url } = await startRouter(t, [{ id: 'd0', role: 'decode', url: sim.url }], { adminToken: ADMIN })
  await post(`${url}/v1/agents`, { agentId: 'slow-agent', engineId: 'eng-slow', role: 'decode', agentUrl: 'http://127.0.0.1:7609', engineUrl: sim.url })
  await post(`${url}/v1/agents`, { agentId: 'gone-agent', engineId: 'eng-gone', role: 'prefill', agentUrl: 'http://127.0.0.1:7610' })
  const stream = await request(`${url}/v1/agents/slow-agent/events?after=0`, { bodyTimeout: 0 })
  let text = ''
  let ended = false
  const seen = new Promise<void>((resolve) => {
    stream.body.on('data', (c: Buffer) => {
      text += c.toString()
      if (/^id: 1$/m.test(text)) resolve()
    })
  })
  stream.body.on('end', () => (ended = true))
  stream.body.on('error', () => undefined)

  const res = await post(`${url}/fault_tolerance/event`, { event_type: 'peer_gone', nodes: { engine_ids: ['eng-gone'] } }, { authorization: `Bearer ${ADMIN}` })
  t.equal(res.status, 202)
  await seen
  // The agent takes a while to apply it; the router is asked to close meanwhile.
  const closing = app.close()
  await new Promise((resolve) => setTimeout(resolve, 300))
  t.notOk(ended, 'the stream stays open while its agent has not acknowledged')
  const ack = await request(`${url}/v1/agents/slow-agent/acks`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ seq: 1 }) })
  await ack.body.dump()
  t.equal(ack.statusCode, 204, 'an ack is still taken while closing')
  await closing
  t.ok(ended, 'then the stream ends and the router closes')
  t.same((await app.events.store.delivery(1))?.applied, ['slow-agent'])
})
