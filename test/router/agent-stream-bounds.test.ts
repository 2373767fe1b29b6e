import { connect, type Socket } from 'node:net'
import t, { type Test } from 'tap'
import { loadConfig } from '../../router/src/config.js'
import { snapshotFrame } from '../../router/src/routes/agent-stream.js'
import { get, post, startRouter, waitFor } from '../helpers/cluster.js'
import { needRedis, startRedis } from '../helpers/redis.js'

// Issue 18 item 3: an agent's event stream holds at most events.streamBufferBytes unsent
// (plus one frame); one that takes nothing for a keep-alive interval, or falls further
// behind than the log holds, is cut, and the agent resumes after the last event it applied.
// One stream per agent: a new one replaces the one it had.

const agent = (id: string, port: number) => ({ agentId: id, engineId: `${id}-engine`, role: 'decode', agentUrl: `http://127.0.0.1:${port}` })
const big = (i: number) => ({ type: 'lease_release' as const, prefillEngineId: 'p', requestIds: [`${'r'.repeat(200)}-${i}`, ...Array.from({ length: 40 }, (_, k) => `${'q'.repeat(200)}-${i}-${k}`)], reason: 'test' })

/** A stream read by hand: paused (nothing read past the socket's buffers) until `resume`. */
function rawStream(url: string, agentId: string, after = 0): { socket: Socket; closed: () => Promise<void>; text: () => string } {
  const { hostname, port } = new URL(url)
  const socket = connect(Number(port), hostname)
  let text = ''
  socket.on('error', () => {})
  socket.on('data', (d: Buffer) => (text += d.toString('latin1')))
  socket.pause()
  socket.write(`GET /v1/agents/${agentId}/events?after=${after} HTTP/1.1\r\nhost: x\r\naccept: text/event-stream\r\n\r\n`)
  let isClosed = false
  socket.once('close', () => (isClosed = true))
  // Bounded: on a router that never cuts, the case fails instead of hanging.
  const closed = async (): Promise<void> => {
    if (!(await waitFor(() => isClosed, 10_000))) throw new Error('the stream was not cut within 10 s')
  }
  return { socket, closed, text: () => text }
}

async function unsent(url: string): Promise<number> {
  return Number(/^handoff_router_agent_stream_unsent_bytes (\d+)/m.exec((await get(`${url}/metrics`)).text)?.[1] ?? Number.NaN)
}

function cutCount(metrics: string, reason: string): number {
  return Number(new RegExp(`handoff_router_agent_streams_cut_total\\{reason="${reason}"\\} (\\d+)`).exec(metrics)?.[1] ?? 0)
}

t.test('a snapshot is written in pieces that join to its one frame', async (t) => {
  for (const n of [0, 1, 7, 3000]) {
    const e = { seq: 41, type: 'snapshot' as const, goneEngineIds: Array.from({ length: n }, (_, i) => `engine-"${i}"-${'x'.repeat(i % 300)}`), at: 1_765_000_000_123.5 }
    const pieces = [...snapshotFrame(e, 4096)]
    t.equal(Buffer.concat(pieces).toString(), `id: 41\ndata: ${JSON.stringify(e)}\n\n`, `${n} ids: the frame JSON.stringify makes`)
    t.ok(pieces.every((p) => p.length < 4096 + 400), `${n} ids: ${pieces.length} pieces, none much past the size`)
  }
})

t.test('a stream that takes nothing is cut once it stalls; the unsent part stays bounded', async (t) => {
  const { url, app } = await startRouter(t, [], { probe: false, events: { keepAliveMs: 100, streamBufferBytes: 16384 } })
  t.equal((await post(`${url}/v1/agents`, agent('slow', 7001))).status, 200)
  const s = rawStream(url, 'slow')
  t.teardown(() => s.socket.destroy())
  await waitFor(() => app.events.agents.get('slow')?.streams === 1)
  // About 9 KB each: far more than the socket buffers take.
  let maxBuffered = 0
  for (let i = 0; i < 2000; i++) {
    await app.events.store.append(big(i), [])
    if (i % 50 === 0) maxBuffered = Math.max(maxBuffered, await unsent(url))
  }
  t.ok(maxBuffered <= 16384 + 16384, `at most the bound plus one frame unsent (${maxBuffered} bytes)`)
  t.ok(await waitFor(async () => cutCount((await get(`${url}/metrics`)).text, 'stalled') === 1, 10_000), 'cut as stalled, while it read nothing')
  s.socket.resume()
  await s.closed()
  t.pass('the agent sees the end of its stream')
  t.equal(app.events.agents.get('slow')?.streams, 0)
})

t.test('a new stream for an agent replaces the one it had', async (t) => {
  const { url, app } = await startRouter(t, [], { probe: false, events: { keepAliveMs: 100 } })
  t.equal((await post(`${url}/v1/agents`, agent('twice', 7002))).status, 200)
  const first = rawStream(url, 'twice')
  first.socket.resume()
  await waitFor(() => app.events.agents.get('twice')?.streams === 1)
  const second = rawStream(url, 'twice')
  second.socket.resume()
  t.teardown(() => second.socket.destroy())
  await first.closed()
  t.pass('the first stream was ended')
  await waitFor(() => app.events.agents.get('twice')?.streams === 1)
  t.equal(app.events.agents.get('twice')?.streams, 1, 'one stream counted')
  await app.events.store.append(big(1), [])
  t.ok(await waitFor(() => second.text().includes('id: 1\n')), 'the second one gets the events')
  t.equal(cutCount((await get(`${url}/metrics`)).text, 'replaced'), 1)
})

async function pacedReplay(t: Test, store?: Record<string, unknown>): Promise<void> {
  const { url, app } = await startRouter(t, [], { probe: false, events: { keepAliveMs: 60_000, streamBufferBytes: 16384 }, ...(store ? { store } : {}) })
  t.equal((await post(`${url}/v1/agents`, agent('late', 7003))).status, 200)
  for (let i = 0; i < 1000; i++) await app.events.store.append(big(i), [])
  const s = rawStream(url, 'late')
  t.teardown(() => s.socket.destroy())
  await waitFor(() => app.events.agents.get('late')?.streams === 1)
  await new Promise((resolve) => setTimeout(resolve, 200))
  const buffered = await unsent(url)
  t.ok(buffered <= 16384 + 16384, `9 MB of backlog, ${buffered} bytes of it unsent`)
  // Live events while the replay waits on the reader: they follow the backlog, none skipped.
  for (let i = 1000; i < 1200; i++) await app.events.store.append(big(i), [])
  s.socket.resume()
  t.ok(await waitFor(() => s.text().includes('id: 1200\n'), 10_000), 'all of it arrives once read')
  const ids = [...s.text().matchAll(/^id: (\d+)$/gm)].map((m) => Number(m[1]))
  t.same(ids, Array.from({ length: 1200 }, (_, i) => i + 1), 'each event once, in order')
}

t.test('a replay from the start of a full log is paced by the reader, not buffered whole', (t) => pacedReplay(t))

t.test('the same with the Redis store', { skip: needRedis(t) }, async (t) => {
  const redis = await startRedis(t)
  await pacedReplay(t, { ...loadConfig({ overrides: {} }).store, kind: 'redis', url: redis.url })
})

t.test('an agent behind retention gets its snapshot whole, in pieces the socket takes, then what follows', async (t) => {
  // 400 engine_ids of 200 characters gone: a snapshot of about 85 KB, past the bound.
  const { url, app } = await startRouter(t, [], { probe: false, events: { keepAliveMs: 60_000, streamBufferBytes: 16384, retention: 100 } })
  t.equal((await post(`${url}/v1/agents`, agent('behind', 7004))).status, 200)
  const gone = Array.from({ length: 400 }, (_, i) => `${'g'.repeat(200)}-${i}`)
  for (const id of gone) await app.events.store.appendPeerGone({ type: 'peer_gone', engineIds: [id], addresses: [], reason: 'test' }, [])
  const s = rawStream(url, 'behind')
  t.teardown(() => s.socket.destroy())
  await waitFor(() => app.events.agents.get('behind')?.streams === 1)
  s.socket.resume()
  t.ok(await waitFor(() => s.text().includes('id: 400\n'), 10_000), 'everything arrives')
  const body = s.text().slice(s.text().indexOf('\r\n\r\n') + 4)
  // Chunked transfer encoding: join the chunks, then read the SSE frames.
  let sse = ''
  for (let at = 0; at < body.length; ) {
    const eol = body.indexOf('\r\n', at)
    const size = Number.parseInt(body.slice(at, eol), 16)
    if (!(size > 0)) break
    sse += body.slice(eol + 2, eol + 2 + size)
    at = eol + 2 + size + 2
  }
  const frames = sse.split('\n\n').filter((f) => f.startsWith('id: '))
  const first = JSON.parse((frames[0] as string).split('\ndata: ')[1] as string)
  t.equal(first.type, 'snapshot')
  t.equal(first.seq, 300, 'the snapshot stands for what retention dropped')
  t.same(first.goneEngineIds, gone, 'every engine_id gone, in order')
  t.same(frames.slice(1).map((f) => Number(/^id: (\d+)/.exec(f)?.[1])), Array.from({ length: 100 }, (_, i) => 301 + i), 'then the held events, each once')
})
