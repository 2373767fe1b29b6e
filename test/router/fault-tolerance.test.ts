import t from 'tap'
import { request } from 'undici'
import { get, post, startRouter } from '../helpers/cluster.js'

/*
 * Issue 9: POST /fault_tolerance/event and GET /fault_tolerance/events/:seq over HTTP (an
 * in-process router), and the agent endpoints they report on: registration, the SSE event
 * stream (replay, live events, keep-alives, closed with the router) and acks.
 */

const ADMIN = 'admin-token-0123'
const AGENT = 'agent-token-0123'
const admin = { authorization: `Bearer ${ADMIN}` }
const instances = [{ id: 'p', role: 'prefill' as const, url: 'http://127.0.0.1:9' }]

t.test('admin token: none configured → 403, missing or wrong → 401', async (t) => {
  const off = await startRouter(t, instances, { probe: false })
  const body = { event_type: 'peer_gone', nodes: { engine_ids: ['x'] } }
  let res = await post(`${off.url}/fault_tolerance/event`, body, admin)
  t.equal(res.status, 403)
  t.equal(res.json<{ error: { code: string } }>().error.code, 'RTR_ERR_ADMIN_DISABLED')
  t.equal((await get(`${off.url}/fault_tolerance/events/1`)).status, 403)

  const on = await startRouter(t, instances, { probe: false, adminToken: ADMIN })
  res = await post(`${on.url}/fault_tolerance/event`, body)
  t.equal(res.status, 401)
  t.equal(res.json<{ error: { code: string } }>().error.code, 'RTR_ERR_ADMIN_UNAUTHORIZED')
  res = await post(`${on.url}/fault_tolerance/event`, body, { authorization: 'Bearer wrong-token-0000' })
  t.equal(res.status, 401)
  t.equal((await get(`${on.url}/fault_tolerance/events/1`)).status, 401)
})

t.test('bad bodies are 400 with a coded error', async (t) => {
  const { url } = await startRouter(t, instances, { probe: false, adminToken: ADMIN })
  const bad: unknown[] = [
    {},
    { event_type: 'lease_release', nodes: {} },
    { event_type: 'peer_gone' },
    { event_type: 'peer_gone', nodes: { engine_ids: 'x' } },
    { event_type: 'peer_gone', nodes: { addresses: ['no-port'] } },
    { event_type: 'peer_gone', nodes: { engine_ids: [''] } },
    { event_type: 'peer_gone', nodes: {}, extra: 1 },
    { event_type: 'peer_gone', nodes: { hosts: ['a:1'] } },
    '{not json',
  ]
  for (const body of bad) {
    const res = await post(`${url}/fault_tolerance/event`, body, admin)
    t.equal(res.status, 400, JSON.stringify(body))
    t.match(res.json<{ error: { code: string } }>().error.code, /^RTR_ERR_INVALID_(REQUEST|JSON)$/)
  }
  const res = await get(`${url}/fault_tolerance/events/abc`, admin)
  t.equal(res.status, 400, 'a sequence is digits')
})

t.test('unknown engine → 202 listing it, seq null; a known one is logged, a repeat is not; delivery', async (t) => {
  const { url } = await startRouter(t, instances, { probe: false, adminToken: ADMIN })
  let res = await post(`${url}/fault_tolerance/event`, { event_type: 'peer_gone', nodes: { engine_ids: ['ghost'], addresses: ['10.0.0.9:5555'] } }, admin)
  t.equal(res.status, 202)
  const logId = res.json<{ log_id: string }>().log_id
  t.match(logId, /^[0-9a-f-]{36}$/, 'the answer names the log')
  t.same(res.json(), { seq: null, log_id: logId, engine_ids: [], unknown: ['ghost', '10.0.0.9:5555'], alive_skipped: [], logged: false })

  for (const [agentId, engineId, port] of [
    ['a1', 'e1', 7001],
    ['a2', 'e2', 7002],
  ] as const) {
    res = await post(`${url}/v1/agents`, { agentId, engineId, role: 'decode', agentUrl: `http://127.0.0.1:${port}` })
    t.equal(res.status, 200)
    t.match(res.json(), { agentId, instanceId: null, lastSeq: 0, routerId: logId, keepAliveMs: 5000 })
  }
  res = await post(`${url}/fault_tolerance/event`, { event_type: 'peer_gone', nodes: { addresses: ['127.0.0.1:7001'] }, reason: 'node drained' }, admin)
  t.equal(res.status, 202)
  t.same(res.json(), { seq: 1, log_id: logId, engine_ids: ['e1'], unknown: [], alive_skipped: [], logged: true })
  res = await post(`${url}/fault_tolerance/event`, { event_type: 'peer_gone', nodes: { engine_ids: ['e1'] } }, admin)
  t.same(res.json(), { seq: 1, log_id: logId, engine_ids: ['e1'], unknown: [], alive_skipped: [], logged: false }, 'a repeat: the same sequence, nothing logged')

  res = await get(`${url}/fault_tolerance/events/1`, admin)
  t.equal(res.status, 200)
  t.same(res.json(), { seq: 1, log_id: logId, type: 'peer_gone', engine_ids: ['e1'], applied: [], expected: ['a1', 'a2'], complete: false })
  t.equal((await get(`${url}/fault_tolerance/events/1?log=${logId}`, admin)).status, 200, 'asked with its log')
  const other = await get(`${url}/fault_tolerance/events/1?log=another-log`, admin)
  t.equal(other.status, 410, 'asked with a log this router does not have')
  t.equal(other.json<{ error: { code: string } }>().error.code, 'RTR_ERR_EVENT_OTHER_LOG')
  t.match(other.json<{ error: { message: string } }>().error.message, new RegExp(`log another-log: that log is gone .* the log is now ${logId}`))
  t.equal((await post(`${url}/v1/agents/a1/acks`, { seq: 1 })).status, 204)
  t.same(res.json<{ applied: string[] }>().applied, [], '(the earlier answer)')
  t.same((await get(`${url}/fault_tolerance/events/1`, admin)).json<{ applied: string[] }>().applied, ['a1'])
  await post(`${url}/v1/agents/a2/acks`, { seq: 1 })
  t.match((await get(`${url}/fault_tolerance/events/1`, admin)).json(), { applied: ['a1', 'a2'], complete: true })

  res = await get(`${url}/fault_tolerance/events/2`, admin)
  t.equal(res.status, 404)
  t.equal(res.json<{ error: { code: string } }>().error.code, 'RTR_ERR_EVENT_NOT_FOUND')
})

t.test('agent endpoints: token, unknown agent, bad bodies', async (t) => {
  const { url } = await startRouter(t, instances, { probe: false, agentToken: AGENT })
  const auth = { authorization: `Bearer ${AGENT}` }
  const reg = { agentId: 'a1', engineId: 'e1', role: 'prefill', agentUrl: 'http://127.0.0.1:7001', engineUrl: 'http://127.0.0.1:9' }
  let res = await post(`${url}/v1/agents`, reg)
  t.equal(res.status, 401)
  t.equal(res.json<{ error: { code: string } }>().error.code, 'RTR_ERR_AGENT_UNAUTHORIZED')
  res = await post(`${url}/v1/agents`, { ...reg, agentUrl: 'ftp://x:1' }, auth)
  t.equal(res.status, 400)
  res = await post(`${url}/v1/agents`, reg, auth)
  t.match(res.json(), { agentId: 'a1', instanceId: 'p', lastSeq: 0 }, 'tied to the instance with that URL')
  res = await post(`${url}/v1/agents/nobody/acks`, { seq: 1 }, auth)
  t.equal(res.status, 404)
  t.equal(res.json<{ error: { code: string } }>().error.code, 'RTR_ERR_AGENT_UNKNOWN')
  res = await get(`${url}/v1/agents/nobody/events`, auth)
  t.equal(res.status, 404)
  t.equal(res.json<{ error: { code: string } }>().error.code, 'RTR_ERR_AGENT_UNKNOWN')
  res = await post(`${url}/v1/agents/a1/acks`, { seq: -1 }, auth)
  t.equal(res.status, 400)
  res = await get(`${url}/v1/agents/a1/events?after=x`, auth)
  t.equal(res.status, 400)
})

/** Reads SSE frames from a live stream until `n` data frames arrived. */
async function frames(url: string, n: number, headers: Record<string, string> = {}): Promise<{ ids: string[]; data: Record<string, unknown>[]; close: () => void }> {
  const ac = new AbortController()
  const res = await request(url, { headers, signal: ac.signal })
  const ids: string[] = []
  const data: Record<string, unknown>[] = []
  let buf = ''
  for await (const chunk of res.body) {
    buf += (chunk as Buffer).toString('utf8')
    let i: number
    while ((i = buf.indexOf('\n\n')) >= 0) {
      const frame = buf.slice(0, i)
      buf = buf.slice(i + 2)
      for (const line of frame.split('\n')) {
        if (line.startsWith('id: ')) ids.push(line.slice(4))
        if (line.startsWith('data: ')) data.push(JSON.parse(line.slice(6)) as Record<string, unknown>)
      }
    }
    if (data.length >= n) break
  }
  return { ids, data, close: () => ac.abort() }
}

t.test('the event stream: replay after N, a snapshot behind retention, live events; the router closing ends it', async (t) => {
  const { app, url } = await startRouter(t, instances, { probe: false, adminToken: ADMIN, events: { retention: 2, keepAliveMs: 100 } })
  await post(`${url}/v1/agents`, { agentId: 'a1', engineId: 'e1', role: 'decode', agentUrl: 'http://127.0.0.1:7001' })
  for (const id of ['g1', 'g2', 'g3']) {
    await post(`${url}/v1/agents`, { agentId: `agent-${id}`, engineId: id, role: 'prefill', agentUrl: `http://127.0.0.1:${id === 'g1' ? 7101 : id === 'g2' ? 7102 : 7103}` })
    await post(`${url}/fault_tolerance/event`, { event_type: 'peer_gone', nodes: { engine_ids: [id] } }, admin)
  }
  // Seq 1 fell out of retention (2): a snapshot stands for it.
  const s = await frames(`${url}/v1/agents/a1/events?after=0`, 3)
  s.close()
  t.same(
    s.data.map((d) => [d.type, d.seq]),
    [
      ['snapshot', 1],
      ['peer_gone', 2],
      ['peer_gone', 3],
    ],
  )
  t.same(s.data[0]?.goneEngineIds, ['g1', 'g2', 'g3'])
  t.same(s.ids, ['1', '2', '3'])

  // Resume with Last-Event-ID; a live event arrives on the open stream.
  const live = frames(`${url}/v1/agents/a1/events`, 1, { 'last-event-id': '3' })
  setTimeout(() => void app.events.releaseLease({ prefillEngineId: 'e1', requestIds: ['r1'], reason: 'client_gone' }), 200)
  const l = await live
  l.close()
  t.match(l.data, [{ seq: 4, type: 'lease_release', prefillEngineId: 'e1', requestIds: ['r1'] }])

  // An open stream does not hold the router's close.
  const res = await request(`${url}/v1/agents/a1/events?after=4`)
  t.equal(res.headers['content-type'], 'text/event-stream')
  const text = res.body.text()
  await new Promise((r) => setTimeout(r, 300)) // a few keep-alive periods
  // An agent that applied everything logged: the close need not wait for it
  // (test/router/graceful-events.test.ts covers one that has not yet).
  const ack = await request(`${url}/v1/agents/a1/acks`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: '{"seq":4}' })
  await ack.body.dump()
  const started = performance.now()
  await app.close()
  t.ok(performance.now() - started < 2000, `closed in ${Math.round(performance.now() - started)} ms with a stream open`)
  t.match(await text, /: keep-alive/, 'keep-alive comments on an idle stream')
})
