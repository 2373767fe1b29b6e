import { mkdtempSync, readFileSync, writeFileSync } from 'node:fs'
import { createServer } from 'node:http'
import { connect, type AddressInfo, type Socket } from 'node:net'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import t from 'tap'
import { request } from 'undici'
import { spawnService, type SpawnedService } from '../../common/spawn.js'
import { startSim, type Teardown } from '../helpers/cluster.js'

/*
 * Issue 18 item 3: the router's memory under hostile load stays bounded. Each shape runs
 * against a fresh router process (so one shape's heap cannot hide another's growth) for a
 * few seconds; the router's resident set is sampled while it runs, and the peak growth over
 * the baseline must stay below a stated bound. The bounds are generous (a loaded 2-core
 * machine, GC timing) yet far below what the shapes cost before the fix (docs/architecture.md
 * "Memory bounds"). Measured on a loaded 2-core machine, before → after the fix: fan-out
 * +1026 → +21..25 MiB, agents +306 → +41 MiB, unread streams +1859 → +19..27 MiB.
 */

const MiB = 1024 * 1024

function rssMiB(pid: number): number {
  const m = /^VmRSS:\s+(\d+) kB/m.exec(readFileSync(`/proc/${pid}/status`, 'utf8'))
  return m ? Number(m[1]) / 1024 : Number.NaN
}

/** Samples a process's RSS every 20 ms until stopped; the peak over the first sample. */
function watchRss(pid: number): { stop(): { baseline: number; peak: number; growth: number } } {
  const baseline = rssMiB(pid)
  let peak = baseline
  const timer = setInterval(() => {
    try {
      peak = Math.max(peak, rssMiB(pid))
    } catch {
      // the process is gone; its last sample stands
    }
  }, 20)
  return {
    stop() {
      clearInterval(timer)
      try {
        peak = Math.max(peak, rssMiB(pid))
      } catch {
        // as above
      }
      return { baseline, peak, growth: peak - baseline }
    },
  }
}

async function routerProcess(t: Teardown, config: Record<string, unknown>): Promise<SpawnedService> {
  const dir = mkdtempSync(join(tmpdir(), 'handoff-mem-'))
  const file = join(dir, 'router.json')
  writeFileSync(file, JSON.stringify({ port: 0, logLevel: 'error', instances: [], ...config }))
  const router = await spawnService({ args: ['router', '--config', file] })
  t.teardown(() => router.stop())
  return router
}

async function postJson(url: string, body: unknown, headers: Record<string, string> = {}): Promise<{ status: number; json: Record<string, unknown> }> {
  const res = await request(url, {
    method: 'POST',
    headers: { 'content-type': 'application/json', ...headers },
    body: typeof body === 'string' ? body : JSON.stringify(body),
    headersTimeout: 60_000,
    bodyTimeout: 60_000,
  })
  const text = await res.body.text()
  let json: Record<string, unknown> = {}
  try {
    json = JSON.parse(text) as Record<string, unknown>
  } catch {
    // a status is enough
  }
  return { status: res.statusCode, json }
}

/** Runs `n` jobs, `width` at a time. */
async function pool(n: number, width: number, job: (i: number) => Promise<void>): Promise<void> {
  let next = 0
  await Promise.all(
    Array.from({ length: width }, async () => {
      while (next < n) await job(next++)
    }),
  )
}

function codeOf(r: { json: Record<string, unknown> }): string | undefined {
  return (r.json.error as { code?: string } | undefined)?.code
}

const fakeAgent = (id: string, i: number, engineId: string) => ({
  agentId: id,
  engineId,
  role: 'decode',
  agentUrl: `http://10.${(i >> 16) & 255}.${(i >> 8) & 255}.${i & 255}:7600`,
})

t.test('a batch with a large pass-through field: legs share its serialisation', async (t) => {
  const p = await startSim(t, ['--role', 'prefill'])
  const d = await startSim(t, ['--role', 'decode'])
  const router = await routerProcess(t, {
    instances: [
      { id: 'p0', role: 'prefill', url: p.url },
      { id: 'd0', role: 'decode', url: d.url },
    ],
  })
  const prompts = Array.from({ length: 100 }, (_, i) => `prompt ${i} of a batch`)
  const warm = await postJson(`${router.url}/v1/completions`, { model: 'handoff/sim-1', prompt: prompts.slice(0, 4), max_tokens: 1 })
  t.equal(warm.status, 200, 'a small batch goes through')
  const body = JSON.stringify({ model: 'handoff/sim-1', prompt: prompts, max_tokens: 1, pass_through: 'x'.repeat(4 * MiB) })
  const pid = router.child.pid as number
  const watch = watchRss(pid)
  const res = await postJson(`${router.url}/v1/completions`, body)
  const m = watch.stop()
  t.equal(res.status, 200, 'the batch is answered')
  t.equal((res.json.choices as unknown[] | undefined)?.length, 100, 'one choice per prompt')
  t.comment(`fan-out: ${(body.length / MiB).toFixed(1)} MiB body x 100 prompts: RSS ${m.baseline.toFixed(0)} -> ${m.peak.toFixed(0)} MiB (+${m.growth.toFixed(0)})`)
  // 100 prompts x 2 legs x 4 MiB, copied per leg, is 800 MiB; shared, a few copies of the body.
  t.ok(m.growth < 160, `RSS growth ${m.growth.toFixed(0)} MiB < 160 MiB`)
})

t.test('thousands of fake agents and re-registrations: the directory is capped', async (t) => {
  const router = await routerProcess(t, {})
  const url = `${router.url}/v1/agents`
  const watch = watchRss(router.child.pid as number)
  const refused: Record<string, number> = {}
  let accepted = 0
  await pool(3000, 16, async (i) => {
    const r = await postJson(url, fakeAgent(`fake-agent-${i}`, i, `engine-${i}`))
    if (r.status === 200) accepted++
    else refused[`${r.status} ${codeOf(r)}`] = (refused[`${r.status} ${codeOf(r)}`] ?? 0) + 1
  })
  // Re-registrations under new engine_ids: each one logs a peer_gone for the old engine_id,
  // expected by every agent in the directory.
  let reRegistered = 0
  await pool(3000, 16, async (k) => {
    const i = k % 1000
    const r = await postJson(url, fakeAgent(`fake-agent-${i}`, i, `engine-${i}-v${k}`))
    if (r.status === 200) reRegistered++
  })
  const m = watch.stop()
  t.comment(`agents: ${accepted} registered, refused ${JSON.stringify(refused)}, ${reRegistered} re-registered: RSS ${m.baseline.toFixed(0)} -> ${m.peak.toFixed(0)} MiB (+${m.growth.toFixed(0)})`)
  t.equal(accepted, 1024, 'limits.maxAgents (default 1024) agents are taken')
  t.same(refused, { '503 RTR_ERR_TOO_MANY_AGENTS': 3000 - 1024 }, 'the rest are refused with a code')
  t.equal(reRegistered, 3000, 're-registering a known agent is never refused')
  t.ok(m.growth < 100, `RSS growth ${m.growth.toFixed(0)} MiB < 100 MiB`)
})

t.test('event streams that never read: paced, and cut once they stall', async (t) => {
  // Keep-alives every 100 ms: a stream that took nothing for one interval is stalled.
  const admin = { authorization: 'Bearer admin-token-mem-0' }
  const router = await routerProcess(t, { events: { keepAliveMs: 100 }, adminToken: 'admin-token-mem-0' })
  const { hostname, port } = new URL(router.url)
  const url = `${router.url}/v1/agents`
  for (let i = 0; i < 100; i++) t.equal((await postJson(url, fakeAgent(`reader-${i}`, i, `reader-engine-${i}`))).status, 200)
  // A full log (events.retention, 10,000) of peer_gones of about 700 bytes each: `churn`
  // registers under a new engine_id (a registration declares nothing gone by itself, issue
  // 18 item 2), then ops declare that engine_id gone.
  const churn = `churn-${'a'.repeat(200)}`
  const goneOne = async (engineId: string): Promise<boolean> => {
    if ((await postJson(url, fakeAgent(churn, 200, engineId))).status !== 200) return false
    const r = await postJson(`${router.url}/fault_tolerance/event`, { event_type: 'peer_gone', nodes: { engine_ids: [engineId] }, reason: 'r'.repeat(500) }, admin)
    return r.status === 202 && r.json.logged === true
  }
  // 500 past it: a stream from the start fell behind the log, so each begins with a snapshot
  // of 10,500 engine_ids gone (2.2 MB), its own, and a router that wrote each whole would hold
  // 100 of them (it writes them a piece at a time as the socket takes them).
  let logged = 0
  await pool(10_500, 16, async (k) => {
    if (await goneOne(`${'e'.repeat(200)}-${k}`)) logged++
  })
  t.equal(logged, 10_500)
  const watch = watchRss(router.child.pid as number)
  // 100 streams from the start of the log (a snapshot, then 7 MB of events each), never read.
  const sockets: Socket[] = []
  let cut = 0
  for (let i = 0; i < 100; i++) {
    const s = connect(Number(port), hostname)
    s.on('error', () => {})
    s.once('close', () => cut++)
    s.write(`GET /v1/agents/reader-${i}/events?after=0 HTTP/1.1\r\nhost: ${hostname}\r\naccept: text/event-stream\r\n\r\n`)
    // Paused, with no 'data' listener: nothing is read past the socket's own buffers.
    s.pause()
    sockets.push(s)
  }
  t.teardown(() => {
    for (const s of sockets) s.destroy()
  })
  // Live events on top, while the streams sit unread.
  await pool(1000, 16, async (k) => {
    await goneOne(`${'e'.repeat(200)}-live-${k}`)
  })
  await new Promise((resolve) => setTimeout(resolve, 500))
  const m = watch.stop()
  // A paused socket does not see the router's FIN: read what is buffered, then the end.
  for (const s of sockets) s.resume()
  const until = Date.now() + 10_000
  while (cut < 100 && Date.now() < until) await new Promise((resolve) => setTimeout(resolve, 50))
  t.comment(`streams: 100 unread streams over a 10,000-event log, a 2.2 MB snapshot first: RSS ${m.baseline.toFixed(0)} -> ${m.peak.toFixed(0)} MiB (+${m.growth.toFixed(0)}), ${cut} streams cut`)
  t.equal(cut, 100, 'every unread stream was cut')
  // 29-32 MiB here (Node 20 and 24); 83-87 MiB when each stream wrote its snapshot whole.
  t.ok(m.growth < 60, `RSS growth ${m.growth.toFixed(0)} MiB < 60 MiB`)
})

t.test('a client that does not read a streamed answer: the router stops reading the engine', async (t) => {
  // An engine that streams 16 KiB frames as fast as its socket takes them, up to 512 MiB.
  const frame = Buffer.from(`data: ${JSON.stringify({ choices: [{ index: 0, text: 'x'.repeat(16 * 1024) }] })}\n\n`)
  let written = 0
  let engineClosed = false
  const engine = createServer((req, res) => {
    if (req.url !== '/v1/completions') return void res.end('{}')
    res.writeHead(200, { 'content-type': 'text/event-stream' })
    res.once('close', () => (engineClosed = true))
    const more = (): void => {
      while (!res.destroyed && written < 512 * MiB) {
        written += frame.length
        if (!res.write(frame)) return void res.once('drain', more)
      }
    }
    req.resume()
    req.once('end', more)
  })
  await new Promise<void>((resolve) => engine.listen(0, '127.0.0.1', resolve))
  t.teardown(() => new Promise((resolve) => engine.close(resolve)))
  const engineUrl = `http://127.0.0.1:${(engine.address() as AddressInfo).port}`
  const router = await routerProcess(t, { instances: [{ id: 'b', role: 'both', url: engineUrl }], health: { intervalMs: 60_000 } })
  const { hostname, port } = new URL(router.url)
  const watch = watchRss(router.child.pid as number)
  const s = connect(Number(port), hostname)
  s.on('error', () => {})
  const payload = JSON.stringify({ model: 'm', prompt: 'p', stream: true })
  s.write(`POST /v1/completions HTTP/1.1\r\nhost: ${hostname}\r\ncontent-type: application/json\r\ncontent-length: ${payload.length}\r\n\r\n${payload}`)
  // Paused, with no 'data' listener: nothing is read past the socket's own buffers.
  s.pause()
  await new Promise((resolve) => setTimeout(resolve, 2000))
  const m = watch.stop()
  const stalled = written
  t.comment(`engine wrote ${(stalled / MiB).toFixed(1)} MiB to an unread stream in 2 s; router RSS +${m.growth.toFixed(0)} MiB`)
  // Socket buffers on the way (engine → router → client) hold some MiB; the rest waits.
  t.ok(stalled < 64 * MiB, `the engine could write ${(stalled / MiB).toFixed(1)} MiB < 64 MiB`)
  t.ok(m.growth < 100, `RSS growth ${m.growth.toFixed(0)} MiB < 100 MiB`)
  s.destroy()
  const until = Date.now() + 5000
  while (!engineClosed && Date.now() < until) await new Promise((resolve) => setTimeout(resolve, 20))
  t.ok(engineClosed, 'the client left: the router closed its call to the engine')
})
