import { request } from 'undici'
import t from 'tap'
import { get, post, startRouter, startSim, waitFor } from '../helpers/cluster.js'

// Issue 6 item 2: every request is counted once, by how it ended, and leaves nothing in flight.
const p = await startSim(t, ['--role', 'prefill', '--seed', '21'])
const d = await startSim(t, ['--role', 'decode', '--seed', '22', '--decode-delay-ms', '30'])
const both = await startSim(t, ['--role', 'both', '--seed', '23'])

const MODEL = 'handoff/sim-1'
const pd = [
  { id: 'p0', role: 'prefill' as const, url: p.url },
  { id: 'd0', role: 'decode' as const, url: d.url },
]

async function metric(url: string, re: RegExp): Promise<number> {
  const m = re.exec((await get(`${url}/metrics`)).text)
  return Number(m?.[1] ?? 0)
}
const inflight = (url: string) => metric(url, /^handoff_router_inflight_requests (\d+)/m)
const outcome = (url: string, mode: string, o: string) => metric(url, new RegExp(`^handoff_router_requests_total\\{mode="${mode}",outcome="${o}"\\} (\\d+)`, 'm'))

t.test("D's own 4xx is relayed and counted as http_400 rather than ok", async (t) => {
  const { url, app } = await startRouter(t, pd, { probe: false })
  // P gets max_tokens 1 and passes; D sees the client's impossible max_tokens and refuses.
  const res = await post(`${url}/v1/completions`, { model: MODEL, prompt: 'hello', max_tokens: 10_000_000 })
  t.equal(res.status, 400)
  t.equal(await outcome(url, 'pd', 'http_400'), 1)
  t.equal(await outcome(url, 'pd', 'ok'), 0)
  t.ok(app.topology.snapshot().instances.every((i) => i.inflight === 0), 'no slot leaked')
})

t.test("an engine's 4xx in single-instance mode is counted as http_400", async (t) => {
  const { url } = await startRouter(t, [{ id: 'b0', role: 'both', url: both.url }], { probe: false })
  const res = await post(`${url}/v1/completions`, { model: MODEL, prompt: 'hello', max_tokens: 10_000_000 })
  t.equal(res.status, 400)
  t.equal(await outcome(url, 'single', 'http_400'), 1)
  t.equal(await outcome(url, 'single', 'ok'), 0)
})

t.test('a stream counts as in flight until it ends', async (t) => {
  const { url } = await startRouter(t, pd, { probe: false })
  const res = await request(`${url}/v1/completions`, {
    method: 'POST',
    body: JSON.stringify({ model: MODEL, prompt: 'stream me', max_tokens: 20, stream: true }),
    headers: { 'content-type': 'application/json' },
  })
  t.equal(res.statusCode, 200)
  t.equal(await inflight(url), 1, 'in flight while streaming')
  await res.body.text()
  t.ok(await waitFor(async () => (await inflight(url)) === 0), 'back to 0 once the stream ended')
  t.equal(await outcome(url, 'pd', 'ok'), 1)
})

t.test("a client that leaves right after D's response head: counted client_gone, nothing in flight", async (t) => {
  const { url, app } = await startRouter(t, pd, { probe: false })
  for (let i = 0; i < 5; i++) {
    const ac = new AbortController()
    const res = await request(`${url}/v1/completions`, {
      method: 'POST',
      body: JSON.stringify({ model: MODEL, prompt: `leave ${i}`, max_tokens: 40, stream: true }),
      headers: { 'content-type': 'application/json' },
      signal: ac.signal,
    })
    t.equal(res.statusCode, 200)
    ac.abort()
    await res.body.text().catch(() => undefined)
  }
  t.ok(await waitFor(async () => (await inflight(url)) === 0), 'the in-flight gauge is back to 0')
  t.ok(await waitFor(() => app.topology.snapshot().instances.every((i) => i.inflight === 0)), "D's slot count is back to 0")
  t.ok(await waitFor(async () => (await outcome(url, 'pd', 'client_gone')) === 5), 'each counted as client_gone')
  t.equal(await outcome(url, 'pd', 'ok'), 0)
})

t.test('a client that leaves at every instant: every request is counted once and nothing leaks', async (t) => {
  const { url, app, logs } = await startRouter(t, pd, { probe: false })
  const delays = [0, 1, 2, 5, 10, 20, 40, 80, 150, 300, 600, 1000]
  let answered = 0
  await Promise.all(
    delays.map(async (ms, i) => {
      const ac = new AbortController()
      setTimeout(() => ac.abort(), ms)
      try {
        const res = await request(`${url}/v1/chat/completions`, {
          method: 'POST',
          body: JSON.stringify({ model: MODEL, messages: [{ role: 'user', content: `instant ${i}` }], max_tokens: 8, stream: i % 2 === 0 }),
          headers: { 'content-type': 'application/json' },
          signal: ac.signal,
        })
        answered++
        await res.body.text()
      } catch {
        // The client left.
      }
    }),
  )
  t.ok(await waitFor(async () => (await inflight(url)) === 0), 'nothing in flight')
  t.ok(await waitFor(() => app.topology.snapshot().instances.every((i) => i.inflight === 0)), 'no slot leaked')
  const text = (await get(`${url}/metrics`)).text
  const counted = [...text.matchAll(/^handoff_router_requests_total\{[^}]*\} (\d+)/gm)].reduce((a, m) => a + Number(m[1]), 0)
  // A client that leaves while its body is still uploading never reaches the handler; every
  // other request settles once: one 'client went away' line per client_gone, none twice.
  const gone = logs.filter((l) => l.msg === 'client went away; upstream work aborted').map((l) => l.reqId)
  t.equal(new Set(gone).size, gone.length, 'no request settled twice')
  t.equal(counted, gone.length + (await outcome(url, 'pd', 'ok')), 'each settled request counted once', { text })
  t.ok(counted >= answered && counted <= delays.length, `${counted} of ${delays.length} reached the handler, ${answered} got an answer head`)
})

t.test("the request-duration histogram carries the client's request id as an OpenMetrics exemplar", async (t) => {
  const { url } = await startRouter(t, pd, { probe: false })
  await post(`${url}/v1/completions`, { model: MODEL, prompt: 'exemplar', max_tokens: 2 }, { 'x-request-id': 'trace-me-7' })
  const res = await get(`${url}/metrics`)
  t.match(String(res.headers['content-type']), /^application\/openmetrics-text/)
  t.match(res.text, /^handoff_router_request_duration_seconds_bucket\{le="[^"]+",mode="pd"\} 1 # \{request_id="trace-me-7"\} /m)
  t.ok(res.text.trimEnd().endsWith('# EOF'))
})
