import t, { type Test } from 'tap'
import { Dispatcher, request } from 'undici'
import { oracleForBody } from '../../sim/src/oracle.js'
import type { HandoffLease, LeaseLedger } from '../../router/src/leases/ledger.js'
import type { RouterConfig } from '../../schemas/router-config.js'
import { freePort } from '../../common/ports.js'
import { get, post, simRequests, startRouter, startSim, waitFor } from '../helpers/cluster.js'

/*
 * The lease ledger on the request path, with real simulator processes and an in-process
 * router: a lease that lapsed before the decode leg is never dispatched (re-prefilled once,
 * or failed with RTR_ERR_LEASE_LAPSED); a lease D never got (a refused connection) is
 * released to P's agent at once; one D was sent is never released by the router (issue 17):
 * a client leaving or a decoder deregistered leaves it to P. A lapse needs time to pass between P's answer and
 * D's leg, which a healthy loopback never gives: the tests backdate the issue time the
 * router records (as a P whose answer reached the router late would). The decoders here
 * answer whole (leases.readCheck engine): the router's own read check is read-check.test.ts.
 */
const ADMIN = 'admin-token-123'
const auth = { authorization: `Bearer ${ADMIN}` }
const MODEL = 'handoff/sim-1'
const body = { model: MODEL, prompt: 'The quick brown fox jumps over the lazy dog', max_tokens: 6 }
const leases = (o: Partial<RouterConfig['leases']> = {}): RouterConfig['leases'] => ({ leaseSeconds: 30, marginMs: 1000, onLapsed: 'reprefill', readCheck: 'engine', proveByWholeAnswer: true, retentionMs: 60_000, maxEntries: 1000, ...o })

const p = await startSim(t, ['--role', 'prefill', '--engine-id', 'eng-p0'])
// D holds a non-streamed answer for 12 × 150 ms: a window between the legs for the cancel test.
const d = await startSim(t, ['--role', 'decode', '--decode-delay-ms', '150'])

async function router(t: Test, o: Partial<RouterConfig['leases']> = {}) {
  const r = await startRouter(
    t,
    [
      { id: 'p0', role: 'prefill', url: p.url },
      { id: 'd0', role: 'decode', url: d.url },
    ],
    { adminToken: ADMIN, leases: leases(o) },
  )
  // A stand-in for P's agent, so lease releases for eng-p0 have someone to be logged for.
  t.equal((await post(`${r.url}/v1/agents`, { agentId: 'agent-p0', engineId: 'eng-p0', role: 'prefill', agentUrl: 'http://127.0.0.1:1', engineUrl: p.url })).status, 200)
  await post(`${p.url}/sim/requests/clear`, {})
  await post(`${d.url}/sim/requests/clear`, {})
  return r
}

/** The first `n` leases the router records are backdated past their expiry − margin. */
function lapseFirst(ledger: LeaseLedger, n: number): void {
  const issue = ledger.issue.bind(ledger)
  let left = n
  ledger.issue = (lease: HandoffLease) => issue(left-- > 0 ? { ...lease, issuedAt: lease.issuedAt - 29_500 } : lease)
}

const legs = async (sim: typeof p): Promise<string[]> => (await simRequests(sim)).filter((r) => r.path === '/v1/completions').map((r) => String(r.headers['x-request-id']))

t.test('policy reprefill: a lapsed lease is prefilled again, under a new id, and the client gets its text', async (t) => {
  const { url, app } = await router(t)
  lapseFirst(app.leases, 1)
  const res = await post(`${url}/v1/completions`, { ...body, max_tokens: 3 })
  t.equal(res.status, 200, res.text)
  t.equal(res.json<{ choices: { text: string }[] }>().choices[0]?.text, oracleForBody('/v1/completions', { ...body, max_tokens: 3 }))
  const pLegs = await legs(p)
  const dLegs = await legs(d)
  t.equal(pLegs.length, 2, 'P got two prefill legs')
  t.not(pLegs[0], pLegs[1], 'each with its own engine request id')
  t.same(dLegs, [pLegs[1]], "D got one leg, with the second lease's id")
  const summary = (await get(`${url}/leases`, auth)).json<{ lapsed: { beforeDispatch: number }; released: Record<string, number> }>()
  t.equal(summary.lapsed.beforeDispatch, 1)
  t.same(summary.released, { lapsed: 1 })
  await app.events.settled()
  const released = (await app.events.store.since(0)).filter((e) => e.type === 'lease_release')
  t.match(released, [{ prefillEngineId: 'eng-p0', reason: 'lapsed' }], "P's agent is told to free the lapsed lease's blocks")
  t.match((await get(`${url}/metrics`)).text, /handoff_router_leases_lapsed_total\{when="before_dispatch"\} 1/)
})

t.test('policy reprefill: a re-prefill that lapses too fails the request, coded', async (t) => {
  const { url, app } = await router(t)
  lapseFirst(app.leases, 2)
  const res = await post(`${url}/v1/completions`, body)
  t.equal(res.status, 503)
  t.equal(res.json<{ error: { code: string } }>().error.code, 'RTR_ERR_LEASE_LAPSED')
  t.equal((await legs(p)).length, 2, 'prefilled once more, not again')
  t.same(await legs(d), [], 'D never got a lapsed lease')
})

t.test('policy fail: a lapsed lease fails the request at once; D is never dispatched', async (t) => {
  const { url, app } = await router(t, { onLapsed: 'fail' })
  lapseFirst(app.leases, 1)
  const res = await post(`${url}/v1/completions`, { ...body, stream: true })
  t.equal(res.status, 503)
  t.match(res.json(), { error: { code: 'RTR_ERR_LEASE_LAPSED', type: 'server_error' } })
  t.equal((await legs(p)).length, 1)
  t.same(await legs(d), [])
  t.match((await get(`${url}/metrics`)).text, /handoff_router_requests_total\{mode="pd",outcome="RTR_ERR_LEASE_LAPSED"\} 1/)
  // The next request is not lapsed: nothing sticks.
  t.equal((await post(`${url}/v1/completions`, { ...body, max_tokens: 2 })).status, 200)
})

t.test('a client that leaves while D holds the request: its lease is abandoned to P, never released', async (t) => {
  const { url, app } = await router(t)
  const ac = new AbortController()
  const pending = request(`${url}/v1/completions`, {
    method: 'POST',
    headers: { 'content-type': 'application/json', 'x-request-id': 'leaving-1' },
    body: JSON.stringify({ ...body, max_tokens: 12 }),
    signal: ac.signal,
  }).then(
    (r: Dispatcher.ResponseData) => r.statusCode,
    (err: Error) => err.name,
  )
  // P answered and D holds the request: the lease went to D, which has not answered yet.
  t.ok(await waitFor(async () => (await get(`${url}/leases`, auth)).json<{ inFlight: { reading: number } }>().inFlight.reading === 1), 'lease being read')
  const listed = (await get(`${url}/leases?instance=p0`, auth)).json<{ leases: { clientRequestId: string; decode: string }[] }>()
  t.match(listed.leases, [{ clientRequestId: 'leaving-1', decode: 'd0' }])
  ac.abort()
  t.equal(await pending, 'AbortError')
  t.ok(
    await waitFor(async () => (await get(`${url}/leases`, auth)).json<{ abandoned: Record<string, number> }>().abandoned.client_gone === 1),
    'the lease is abandoned',
  )
  await app.events.settled()
  t.same(
    (await app.events.store.since(0)).filter((e) => e.type === 'lease_release'),
    [],
    'no lease_release: D may be reading, so only D (its read-done) or P (expiry) ends it',
  )
  const summary = (await get(`${url}/leases?instance=p0`, auth)).json<{ inFlight: { reading: number }; released: Record<string, number>; leases: { abandonedAt?: number; reason?: string }[] }>()
  t.same(summary.inFlight, { issued: 0, reading: 1 }, 'still counted unread (a drain of P waits for it)')
  t.same(summary.released, {})
  t.match(summary.leases, [{ abandonedAt: Number, reason: 'client_gone' }])
})

t.test('a decoder that refused the connection never got the params: the lease is released to P at once', async (t) => {
  const dead = await freePort()
  const r = await startRouter(
    t,
    [
      { id: 'p0', role: 'prefill', url: p.url },
      { id: 'd-dead', role: 'decode', url: `http://127.0.0.1:${dead}` },
    ],
    { adminToken: ADMIN, leases: leases(), probe: false },
  )
  t.equal((await post(`${r.url}/v1/agents`, { agentId: 'agent-p0', engineId: 'eng-p0', role: 'prefill', agentUrl: 'http://127.0.0.1:1', engineUrl: p.url })).status, 200)
  const res = await post(`${r.url}/v1/completions`, body)
  t.equal(res.status, 503)
  t.equal(res.json<{ error: { code: string } }>().error.code, 'RTR_ERR_UPSTREAM_UNAVAILABLE')
  await r.app.events.settled()
  t.match((await r.app.events.store.since(0)).filter((e) => e.type === 'lease_release'), [{ prefillEngineId: 'eng-p0', reason: 'decode_failed' }])
  t.same((await get(`${r.url}/leases`, auth)).json<{ released: Record<string, number> }>().released, { decode_failed: 1 })
})

t.test('a decoder deregistered while it holds a request being read: the lease stays P\'s, D answers with its own KV', async (t) => {
  const { url, app } = await router(t)
  const pending = post(`${url}/v1/completions`, { ...body, max_tokens: 12 })
  t.ok(await waitFor(async () => (await get(`${url}/leases`, auth)).json<{ byDecode: Record<string, number> }>().byDecode.d0 === 1))
  const del = await request(`${url}/admin/instances/d0`, { method: 'DELETE', headers: auth })
  t.equal(del.statusCode, 200)
  await del.body.dump()
  await app.events.settled()
  t.same((await app.events.store.since(0)).filter((e) => e.type === 'lease_release'), [], 'removing a decoder releases nothing')
  const res = await pending
  t.equal(res.status, 200, 'the request D was reading finishes')
  t.equal(res.json<{ choices: { text: string }[] }>().choices[0]?.text, oracleForBody('/v1/completions', { ...body, max_tokens: 12 }))
  const summary = (await get(`${url}/leases`, auth)).json<{ released: Record<string, number>; inFlight: { reading: number } }>()
  t.same(summary.released, {})
  t.same(summary.inFlight, { issued: 0, reading: 0 }, 'D answered: the read is done')
})
