import { request } from 'undici'
import t from 'tap'
import { get, post, simRequests, startRouter, startSim, sseEvents, waitFor } from '../helpers/cluster.js'

// P logs at info so a test can see it noticing that the router aborted its leg.
const p = await startSim(t, ['--role', 'prefill', '--seed', '1', '--log-level', 'info'])
const d = await startSim(t, ['--role', 'decode', '--seed', '2', '--decode-delay-ms', '20'])
const instances = [
  { id: 'p0', role: 'prefill' as const, url: p.url },
  { id: 'd0', role: 'decode' as const, url: d.url },
]
// Short timeouts so stalls turn into 504s quickly; no probes, so health stays as configured.
const { url, logs, app } = await startRouter(t, instances, {
  probe: false,
  timeouts: { connectMs: 1000, prefillMs: 700, decodeHeadersMs: 700, generationMs: 700, idleMs: 700, upstreamKeepAliveMs: 4000 },
  health: { intervalMs: 5000, timeoutMs: 500, unhealthyThreshold: 1000, baseEjectionMs: 1000, maxEjectionMs: 1000 },
})

const body = { model: 'handoff/sim-1', prompt: 'failure modes', max_tokens: 6 }
const noFaults = { errorRate: 0, garbageRate: 0, stallRate: 0, disconnectRate: 0 }

async function faults(sim: typeof p, f: Record<string, number>): Promise<void> {
  const res = await post(`${sim.url}/sim/faults`, f)
  if (res.status !== 200) throw new Error(`faults: ${res.text}`)
}
async function running(sim: typeof p): Promise<number> {
  const m = /^vllm:num_requests_running\{[^}]*\} (\d+)/m.exec((await get(`${sim.url}/metrics`)).text)
  return Number(m?.[1] ?? NaN)
}
function code(res: { json<T>(): T }): string {
  return res.json<{ error: { code: string } }>().error.code
}

t.beforeEach(async () => {
  await faults(p, noFaults)
  await faults(d, noFaults)
  await post(`${p.url}/sim/requests/clear`, {})
  await post(`${d.url}/sim/requests/clear`, {})
})

t.test('P answers 500: 502 with the upstream status code, D never called', async (t) => {
  await faults(p, { errorRate: 1 })
  const res = await post(`${url}/v1/completions`, body)
  t.equal(res.status, 502)
  t.equal(code(res), 'RTR_ERR_UPSTREAM_STATUS')
  t.match(res.json<{ error: { message: string } }>().error.message, /prefill instance p0 failed with HTTP 500/)
  t.same(await simRequests(d), [], 'no decode leg')
})

t.test('P answers garbage: 502 bad response', async (t) => {
  await faults(p, { garbageRate: 1 })
  const res = await post(`${url}/v1/completions`, body)
  t.equal(res.status, 502)
  t.equal(code(res), 'RTR_ERR_UPSTREAM_BAD_RESPONSE')
  t.same(await simRequests(d), [])
})

t.test('P never answers: 504 after the prefill timeout, and the P request is aborted', async (t) => {
  await faults(p, { stallRate: 1 })
  const started = Date.now()
  const res = await post(`${url}/v1/completions`, body)
  t.equal(res.status, 504)
  t.equal(code(res), 'RTR_ERR_UPSTREAM_TIMEOUT')
  t.ok(Date.now() - started < 5000, 'bounded by the configured timeout')
  t.same(await simRequests(d), [])
})

t.test('P drops the connection: 502 reset', async (t) => {
  await faults(p, { disconnectRate: 1 })
  const res = await post(`${url}/v1/completions`, body)
  t.equal(res.status, 502)
  t.equal(code(res), 'RTR_ERR_UPSTREAM_RESET')
})

t.test('D answers 500: 502, non-streamed and streamed (before any byte)', async (t) => {
  await faults(d, { errorRate: 1 })
  const res = await post(`${url}/v1/completions`, body)
  t.equal(res.status, 502)
  t.equal(code(res), 'RTR_ERR_UPSTREAM_STATUS')
  t.match(res.json<{ error: { message: string } }>().error.message, /decode instance d0/)
  const s = await post(`${url}/v1/completions`, { ...body, stream: true })
  t.equal(s.status, 502, 'nothing was sent yet, so a proper status')
})

async function requestsCounted(outcome: string): Promise<number> {
  const m = new RegExp(`^handoff_router_requests_total\\{mode="pd",outcome="${outcome}"\\} (\\d+)`, 'm').exec((await get(`${url}/metrics`)).text)
  return Number(m?.[1] ?? 0)
}

t.test('D closes mid-stream: the stream ends with an error event', async (t) => {
  await faults(d, { disconnectRate: 1 })
  const resetsBefore = await requestsCounted('RTR_ERR_UPSTREAM_RESET')
  const res = await post(`${url}/v1/completions`, { ...body, stream: true })
  t.equal(res.status, 200, 'headers were already relayed')
  const events = sseEvents(res.text)
  const last = events.filter((e) => e !== '[DONE]').at(-1) as { error?: { code: string } } | undefined
  t.equal(last?.error?.code, 'RTR_ERR_UPSTREAM_RESET')
  t.equal(events.at(-1), '[DONE]')
  // The request is counted by how the stream ended, not by its 200 head.
  t.equal(await requestsCounted('RTR_ERR_UPSTREAM_RESET'), resetsBefore + 1)
})

t.test('D stalls before answering: 504', async (t) => {
  await faults(d, { stallRate: 1 })
  const res = await post(`${url}/v1/chat/completions`, { model: 'handoff/sim-1', messages: [{ role: 'user', content: 'x' }], max_tokens: 3 })
  t.equal(res.status, 504)
  t.equal(code(res), 'RTR_ERR_UPSTREAM_TIMEOUT')
})

t.test('a client that disconnects mid-stream aborts the decode leg', async (t) => {
  const ac = new AbortController()
  const res = await request(`${url}/v1/completions`, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify({ ...body, max_tokens: 200, stream: true }),
    signal: ac.signal,
  })
  t.equal(res.statusCode, 200)
  // Read one chunk, then walk away.
  for await (const _chunk of res.body) break
  ac.abort()
  t.ok(await waitFor(async () => (await running(d)) === 0, 5000), 'D stopped generating')
  t.ok(await waitFor(() => logs.some((l) => l.msg === 'client went away; upstream work aborted'), 3000), 'logged')
  t.ok(await waitFor(async () => (await requestsCounted('client_gone')) === 1, 3000), 'counted as client_gone')
})

t.test('a client that disconnects during prefill aborts the prefill leg and never reaches D', async (t) => {
  await faults(p, { stallRate: 1 })
  const ac = new AbortController()
  const pending = request(`${url}/v1/completions`, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify(body),
    signal: ac.signal,
  }).catch((err: Error) => err)
  t.ok(await waitFor(async () => (await simRequests(p)).length === 1, 3000), 'P is working on it')
  ac.abort()
  t.type(await pending, Error)
  t.ok(await waitFor(() => /"msg":"client went away"/.test(p.output()), 3000), 'P saw the leg aborted')
  t.same(await simRequests(d), [])
})

t.test('an unreachable P: 503 unavailable', async (t) => {
  const { url: u2 } = await startRouter(
    t,
    [
      { id: 'gone', role: 'prefill', url: 'http://127.0.0.1:9' },
      { id: 'd0', role: 'decode', url: d.url },
    ],
    { probe: false },
  )
  const res = await post(`${u2}/v1/completions`, body)
  t.equal(res.status, 503)
  t.equal(code(res), 'RTR_ERR_UPSTREAM_UNAVAILABLE')
})

t.test('with probes, a dead P is taken out and D serves alone', async (t) => {
  const { url: u3 } = await startRouter(t, [
    { id: 'gone', role: 'prefill', url: 'http://127.0.0.1:9' },
    { id: 'd0', role: 'decode', url: d.url },
  ])
  const res = await post(`${u3}/v1/completions`, body)
  t.equal(res.status, 200)
  const dr = (await simRequests(d)).filter((r) => r.path === '/v1/completions')
  t.equal(dr.length, 1)
  t.notOk(dr[0] && 'kv_transfer_params' in dr[0].body, 'D prefilled locally: no params were invented')
})

t.test('no decoder at all: 503 no instance; readiness says so', async (t) => {
  const { url: u4 } = await startRouter(t, [{ id: 'p0', role: 'prefill', url: p.url }])
  const res = await post(`${u4}/v1/completions`, body)
  t.equal(res.status, 503)
  t.equal(code(res), 'RTR_ERR_NO_INSTANCE')
  const ready = await get(`${u4}/readyz`)
  t.equal(ready.status, 503)
  t.match(ready.json(), { ready: false, reason: /decode/ })
})

// Regression: after the failures above, a keep-alive connection the server still counted as
// busy held app.close() for its 72 s keep-alive timeout.
t.test('the router closes promptly after all of the above', async (t) => {
  const started = Date.now()
  await app.close()
  t.ok(Date.now() - started < 5000, `closed in ${Date.now() - started} ms`)
})
