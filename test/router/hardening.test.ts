import { createServer, type IncomingMessage, type ServerResponse } from 'node:http'
import { createServer as createNetServer, type Socket } from 'node:net'
import type { AddressInfo } from 'node:net'
import t from 'tap'
import { loadConfig } from '../../router/src/config.js'
import { get, post, simRequests, sseEvents, startRouter, startSim, type Teardown } from '../helpers/cluster.js'

// Issue 6 item 8 and the retry rules: misbehaving engines are small fixture servers here,
// since the simulator only misbehaves in whole frames; healthy ones are real simulators.
const MODEL = 'handoff/sim-1'

async function fixture(t: Teardown, handler: (req: IncomingMessage, res: ServerResponse, body: string) => void): Promise<string> {
  const server = createServer((req, res) => {
    let body = ''
    req.on('data', (c: Buffer) => (body += c.toString()))
    req.on('end', () => handler(req, res, body))
  })
  await new Promise<void>((r) => server.listen(0, '127.0.0.1', r))
  t.teardown(() => new Promise<void>((r) => server.close(() => r())).then(() => server.closeAllConnections()))
  return `http://127.0.0.1:${(server.address() as AddressInfo).port}`
}

/** A port nothing listens on: connections to it are refused. */
async function deadPort(): Promise<string> {
  const s = createNetServer()
  await new Promise<void>((r) => s.listen(0, '127.0.0.1', r))
  const port = (s.address() as AddressInfo).port
  await new Promise<void>((r) => s.close(() => r()))
  return `http://127.0.0.1:${port}`
}


const p = await startSim(t, ['--role', 'prefill', '--seed', '31'])
const d = await startSim(t, ['--role', 'decode', '--seed', '32'])

t.test('text/plain gets the documented 415', async (t) => {
  const { url } = await startRouter(t, [{ id: 'b', role: 'both', url: d.url }], { probe: false })
  const res = await post(`${url}/v1/completions`, JSON.stringify({ model: MODEL, prompt: 'x' }), { 'content-type': 'text/plain' })
  t.equal(res.status, 415)
  t.equal(res.json<{ error: { code: string } }>().error.code, 'RTR_ERR_UNSUPPORTED_MEDIA_TYPE')
})

t.test('the Bearer scheme is case-insensitive', async (t) => {
  const { url } = await startRouter(t, [{ id: 'b', role: 'both', url: d.url }], { probe: false, apiKeys: ['key-12345678'] })
  for (const scheme of ['Bearer', 'bearer', 'BEARER']) {
    const res = await get(`${url}/v1/models`, { authorization: `${scheme} key-12345678` })
    t.equal(res.status, 200, scheme)
  }
  t.equal((await get(`${url}/v1/models`, { authorization: 'Basic key-12345678' })).status, 401)
})

t.test('D cuts a frame mid-way: the client gets whole frames and then a whole error event', async (t) => {
  const broken = await fixture(t, (_req, res) => {
    res.writeHead(200, { 'content-type': 'text/event-stream' })
    res.write('data: {"id":"x","object":"text_completion","choices":[{"index":0,"text":"a"}]}\n\n')
    res.write('data: {"id":"x","object":"text_com', () => setTimeout(() => res.socket?.destroy(), 20))
  })
  const { url } = await startRouter(t, [{ id: 'b', role: 'both', url: broken }], { probe: false })
  const res = await post(`${url}/v1/completions`, { model: MODEL, prompt: 'x', stream: true })
  t.equal(res.status, 200)
  t.notMatch(res.text, /text_com[^p]/, 'the broken half never reached the client')
  const events = sseEvents(res.text)
  t.equal(events.length, 3, 'one token frame, the error event, [DONE]')
  t.match(events[1], { error: { code: 'RTR_ERR_UPSTREAM_RESET' } })
  t.equal(events[2], '[DONE]')
})

t.test("upstream keep-alive ends before uvicorn's 5 s", async (t) => {
  t.ok(loadConfig().timeouts.upstreamKeepAliveMs < 5000)
})

t.test('a request on a reused socket the engine closed while idle is sent again on a fresh one', async (t) => {
  // Answers the first request of each connection and keeps it open; the second request on a
  // connection is read and dropped unanswered, as an engine closing an idle socket does.
  const seen: string[] = []
  const server = createNetServer((socket: Socket) => {
    let requests = 0
    socket.on('data', (chunk: Buffer) => {
      if (!chunk.toString().includes('\r\n\r\n')) return
      requests++
      seen.push(`conn:${socket.remotePort} req:${requests}`)
      if (requests > 1) {
        socket.destroy()
        return
      }
      const body = JSON.stringify({ id: 'c', object: 'text_completion', model: MODEL, choices: [{ index: 0, text: 'ok', finish_reason: 'length' }] })
      socket.write(`HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: ${Buffer.byteLength(body)}\r\nconnection: keep-alive\r\n\r\n${body}`)
    })
  })
  await new Promise<void>((r) => server.listen(0, '127.0.0.1', r))
  t.teardown(() => new Promise<void>((r) => server.close(() => r())))
  const engine = `http://127.0.0.1:${(server.address() as AddressInfo).port}`
  const { url } = await startRouter(t, [{ id: 'b', role: 'both', url: engine }], { probe: false })
  const first = await post(`${url}/v1/completions`, { model: MODEL, prompt: 'x' })
  t.equal(first.status, 200)
  const second = await post(`${url}/v1/completions`, { model: MODEL, prompt: 'y' })
  t.equal(second.status, 200, 'answered after one retry on a new connection')
  t.equal(seen.length, 3, 'the engine saw: first, the dropped second, the retry')
})

t.test('a P that never finishes its answer is cut at prefillMs for the whole answer', async (t) => {
  // Headers at once, then a byte every 150 ms: no gap reaches prefillMs, the whole does.
  const trickle = await fixture(t, (_req, res) => {
    res.writeHead(200, { 'content-type': 'application/json' })
    const timer = setInterval(() => res.write(' '), 150)
    res.on('close', () => clearInterval(timer))
  })
  const { url } = await startRouter(
    t,
    [
      { id: 'p0', role: 'prefill', url: trickle },
      { id: 'd0', role: 'decode', url: d.url },
    ],
    { probe: false, timeouts: { connectMs: 1000, prefillMs: 600, decodeHeadersMs: 5000, generationMs: 5000, idleMs: 5000, upstreamKeepAliveMs: 4000 } },
  )
  const started = Date.now()
  const res = await post(`${url}/v1/completions`, { model: MODEL, prompt: 'x' })
  t.equal(res.status, 504)
  t.equal(res.json<{ error: { code: string } }>().error.code, 'RTR_ERR_UPSTREAM_TIMEOUT')
  const took = Date.now() - started
  // Below twice prefillMs: the deadline covers the whole answer, it is not restarted per chunk.
  t.ok(took >= 550 && took < 1200, `cut after ${took} ms, not at twice prefillMs`)
})

t.test('a refused prefill connection is retried once on another P', async (t) => {
  await post(`${p.url}/sim/requests/clear`, {})
  const { url, app } = await startRouter(
    t,
    [
      { id: 'p-dead', role: 'prefill', url: await deadPort() },
      { id: 'p-live', role: 'prefill', url: p.url },
      { id: 'd0', role: 'decode', url: d.url },
    ],
    { probe: false },
  )
  for (let i = 0; i < 4; i++) {
    const res = await post(`${url}/v1/completions`, { model: MODEL, prompt: `retry ${i}`, max_tokens: 3 })
    t.equal(res.status, 200)
  }
  t.equal((await simRequests(p)).filter((r) => r.path === '/v1/completions').length, 4, 'every prefill ended on the live P')
  t.ok(app.topology.snapshot().instances.every((i) => i.inflight === 0))
})

t.test('a refused decode connection is retried once on another D with the same params', async (t) => {
  await post(`${p.url}/sim/requests/clear`, {})
  await post(`${d.url}/sim/requests/clear`, {})
  const { url } = await startRouter(
    t,
    [
      { id: 'p0', role: 'prefill', url: p.url },
      { id: 'd-dead', role: 'decode', url: await deadPort() },
      { id: 'd-live', role: 'decode', url: d.url },
    ],
    { probe: false },
  )
  for (let i = 0; i < 4; i++) {
    const res = await post(`${url}/v1/completions`, { model: MODEL, prompt: `decode retry ${i}`, max_tokens: 3 })
    t.equal(res.status, 200)
  }
  const prefills = (await simRequests(p)).filter((r) => r.path === '/v1/completions')
  const decodes = (await simRequests(d)).filter((r) => r.path === '/v1/completions')
  t.equal(prefills.length, 4, 'one prefill per request: no re-prefill for the retry')
  t.equal(decodes.length, 4)
  t.ok(decodes.every((r) => (r.body.kv_transfer_params as { do_remote_prefill?: boolean } | undefined)?.do_remote_prefill === true), 'D read the KV')
})

t.test('nothing is retried once the engine got the request (a 5xx)', async (t) => {
  let calls = 0
  const failing = await fixture(t, (_req, res) => {
    calls++
    res.writeHead(500, { 'content-type': 'application/json' }).end('{"error":{"message":"bad input"}}')
  })
  const { url, app } = await startRouter(t, [{ id: 'b', role: 'both', url: failing }], {
    probe: false,
    health: { intervalMs: 5000, timeoutMs: 500, unhealthyThreshold: 1, baseEjectionMs: 60_000, maxEjectionMs: 60_000 },
  })
  const res = await post(`${url}/v1/completions`, { model: MODEL, prompt: 'x' })
  t.equal(res.status, 502)
  t.equal(calls, 1)
  t.ok(app.topology.snapshot().instances[0]?.healthy, "an engine's 5xx for a bad input does not eject it")
})

t.test('single-instance mode: a refused connection is retried once on another instance', async (t) => {
  await post(`${d.url}/sim/requests/clear`, {})
  const both = await startSim(t, ['--role', 'both', '--seed', '33'])
  const { url } = await startRouter(
    t,
    [
      { id: 'b-dead', role: 'both', url: await deadPort() },
      { id: 'b-live', role: 'both', url: both.url },
    ],
    { probe: false },
  )
  for (let i = 0; i < 4; i++) t.equal((await post(`${url}/v1/completions`, { model: MODEL, prompt: `single ${i}`, max_tokens: 2 })).status, 200)
  t.equal((await simRequests(both)).filter((r) => r.path === '/v1/completions').length, 4)
})
