import { type ChildProcess, spawn, spawnSync } from 'node:child_process'
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs'
import { cpus, loadavg, tmpdir, totalmem } from 'node:os'
import { join } from 'node:path'
import { parseArgs } from 'node:util'
import { Agent, request } from 'undici'
import { freePort } from '../common/ports.js'
import { spawnService, type SpawnedService } from '../common/spawn.js'
import { decodeBody, prefillBody } from '../router/src/proxy/legs.js'
import { closedLoop, emptyLoad, mean, mergeLoads, percentile, type LoadResult } from './load.js'
import { cpuSeconds } from './proc-stats.js'

/*
 * `handoff bench routers`: issue 10's price of several routers on one Redis, in one run.
 * - Requests: the same P/D completions (1 P + 1 D simulator, --kv none, zero delays) through
 *   (a) one router on the memory store, (b) two routers on one Redis, requests alternating
 *   between them, (c) one router on Redis (Redis's cost without a second process), beside a
 *   direct two-leg client (no router: the floor). Rounds alternate the paths.
 * - Fan-out: N light SSE clients posing as agents (registered, then streaming), spread over
 *   the setup's routers; the time from POST /fault_tolerance/event on the first router to
 *   each stream receiving the event.
 */

const HELP = `usage: handoff bench routers [--quick] [--concurrency 16,64] [--seconds S] [--requests N]
                             [--rounds R] [--agents 10,100] [--events E]

Several routers on one Redis against one router in memory, side by side in one run:
throughput and latency of P/D completions through (a) 1 router, memory store, (b) 2 routers
on one Redis (requests round-robin), (c) 1 router on Redis, beside a direct client; then
event fan-out from POST /fault_tolerance/event to N agent streams spread over the routers.
Starts its own redis-server (loopback, nothing persisted); fails if it is not installed.
Prints markdown tables (docs/benchmarks.md).
`

const ADMIN = 'bench-routers-admin-token'
const MODEL = 'handoff/sim-1'

interface Setup {
  key: string
  label: string
  routers: SpawnedService[]
  /** The setup's router processes and its Redis, if any: the CPU it spends on routing. */
  pids: number[]
  redisPid: number | undefined
}

function list(value: string | undefined, fallback: number[]): number[] {
  if (!value) return fallback
  const out = value.split(',').map((v) => Number(v.trim()))
  if (out.some((n) => !Number.isInteger(n) || n <= 0)) throw new Error(`bad list '${value}'`)
  return out
}

const f = (n: number, digits = 2): string => (Number.isFinite(n) ? n.toFixed(digits) : 'n/a')
const ratio = (x: number, base: number): string => (Number.isFinite(x / base) ? `${(x / base).toFixed(2)}×` : 'n/a')

/** redis-server's version, or undefined when it is not installed. */
function redisVersion(): string | undefined {
  const out = spawnSync('redis-server', ['--version'], { encoding: 'utf8' })
  if (out.status !== 0) return undefined
  return /v=(\S+)/.exec(out.stdout)?.[1] ?? 'unknown'
}

/** A private redis-server on a free loopback port; ready once it logs that it accepts connections. */
async function startRedisServer(): Promise<{ url: string; pid: number; stop(): Promise<void> }> {
  const port = await freePort()
  const child: ChildProcess = spawn('redis-server', ['--port', String(port), '--bind', '127.0.0.1', '--save', '', '--appendonly', 'no'], { stdio: ['ignore', 'pipe', 'pipe'] })
  let log = ''
  await new Promise<void>((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error(`redis-server did not start in 10 s:\n${log}`)), 10_000)
    const onData = (d: Buffer): void => {
      log += d.toString()
      if (log.includes('Ready to accept connections')) {
        clearTimeout(timer)
        resolve()
      }
    }
    child.stdout?.on('data', onData)
    child.stderr?.on('data', onData)
    child.once('error', (err) => {
      clearTimeout(timer)
      reject(err)
    })
    child.once('exit', (code) => {
      clearTimeout(timer)
      reject(new Error(`redis-server exited (${code}):\n${log}`))
    })
  })
  child.stdout?.resume()
  child.stderr?.resume()
  return {
    url: `redis://127.0.0.1:${port}`,
    pid: child.pid as number,
    stop: async () => {
      if (child.exitCode !== null || child.signalCode !== null) return
      const exited = new Promise((resolve) => child.once('exit', resolve))
      child.kill('SIGTERM')
      await exited
    },
  }
}

// ---- requests -------------------------------------------------------------------------------

interface Measured {
  load: LoadResult
  routerCpu: number
  redisCpu: number
}

function requestRows(concurrency: number, direct: LoadResult, setups: Setup[], results: Map<string, Measured>): string[] {
  const sorted = (l: LoadResult): number[] => [...l.latenciesMs].sort((a, b) => a - b)
  const floor = mean(direct.latenciesMs)
  const ds = sorted(direct)
  const base = results.get('a')
  const baseRps = base ? base.load.latenciesMs.length / base.load.wallSeconds : NaN
  const baseSorted = base ? sorted(base.load) : []
  const rows = [`| ${concurrency} | direct, no router | ${ds.length} | ${f(ds.length / direct.wallSeconds, 0)} | ${f(percentile(ds, 50))} / ${f(percentile(ds, 99))} | — | — | — | — | ${direct.errors} |`]
  for (const s of setups) {
    const m = results.get(s.key)
    if (!m) continue
    const ls = sorted(m.load)
    const rps = ls.length / m.load.wallSeconds
    const p50 = percentile(ls, 50)
    const p99 = percentile(ls, 99)
    const vsA = s.key === 'a' ? '—' : ratio(rps, baseRps)
    const latVsA = s.key === 'a' ? '—' : `${ratio(p50, percentile(baseSorted, 50))} / ${ratio(p99, percentile(baseSorted, 99))}`
    const perReq = (seconds: number): number => (seconds / Math.max(1, ls.length)) * 1000
    const cpu = `${f(perReq(m.routerCpu), 3)} / ${s.redisPid === undefined ? '—' : f(perReq(m.redisCpu), 3)}`
    rows.push(`| ${concurrency} | ${s.label} | ${ls.length} | ${f(rps, 0)} | ${f(p50)} / ${f(p99)} | ${f(mean(m.load.latenciesMs) - floor)} | ${vsA} | ${latVsA} | ${cpu} | ${m.load.errors} |`)
  }
  return rows
}

async function requestsTable(o: { p: SpawnedService; d: SpawnedService; setups: Setup[]; concurrencies: number[]; seconds: number; maxRequests: number; rounds: number }): Promise<string[]> {
  const dispatcher = new Agent({ connections: 256, keepAliveTimeout: 30_000 })
  const body = { model: MODEL, prompt: 'the quick brown fox jumps over the lazy dog '.repeat(5), max_tokens: 8 }
  const payload = JSON.stringify(body)
  const postJson = async (url: string, json: string): Promise<Record<string, unknown>> => {
    const res = await request(url, { method: 'POST', dispatcher, body: json, headers: { 'content-type': 'application/json' } })
    const out = (await res.body.json()) as Record<string, unknown>
    if (res.statusCode !== 200) throw new Error(`HTTP ${res.statusCode}`)
    return out
  }
  const direct = async (): Promise<void> => {
    const pr = await postJson(`${o.p.url}/v1/completions`, JSON.stringify(prefillBody(body)))
    await postJson(`${o.d.url}/v1/completions`, JSON.stringify(decodeBody(body, pr.kv_transfer_params as Record<string, unknown>)))
  }
  // Round-robin over the setup's routers, one counter per setup.
  const via = (s: Setup): (() => Promise<void>) => {
    let next = 0
    return async () => {
      const r = s.routers[next++ % s.routers.length] as SpawnedService
      await postJson(`${r.url}/v1/completions`, payload)
    }
  }
  const senders = new Map(o.setups.map((s) => [s.key, via(s)]))
  const rows: string[] = []
  try {
    for (const concurrency of o.concurrencies) {
      const loop = { concurrency, maxRequests: o.maxRequests, maxSeconds: o.seconds }
      for (const send of [direct, ...senders.values()]) await closedLoop({ ...loop, maxRequests: Math.min(100, o.maxRequests), send })
      let floor = emptyLoad()
      const results = new Map<string, Measured>()
      for (let r = 0; r < o.rounds; r++) {
        const d = await closedLoop({ ...loop, send: direct })
        floor = mergeLoads(floor, d)
        // Each round starts one setup later, so none always runs right after the direct client.
        for (const s of o.setups.slice(r % o.setups.length).concat(o.setups.slice(0, r % o.setups.length))) {
          const routers = (): number => s.pids.reduce((sum, pid) => sum + cpuSeconds(pid), 0)
          const redis = (): number => (s.redisPid === undefined ? 0 : cpuSeconds(s.redisPid))
          const [routersBefore, redisBefore] = [routers(), redis()]
          const load = await closedLoop({ ...loop, send: senders.get(s.key) as () => Promise<void> })
          const prev = results.get(s.key) ?? { load: emptyLoad(), routerCpu: 0, redisCpu: 0 }
          results.set(s.key, {
            load: mergeLoads(prev.load, load),
            routerCpu: prev.routerCpu + routers() - routersBefore,
            redisCpu: prev.redisCpu + redis() - redisBefore,
          })
        }
      }
      process.stderr.write(`requests measured at concurrency ${concurrency}\n`)
      rows.push(...requestRows(concurrency, floor, o.setups, results))
    }
  } finally {
    await dispatcher.close()
  }
  return rows
}

// ---- event fan-out --------------------------------------------------------------------------

/** One fake agent's SSE stream: when each event id arrived, and a wait for a given one. */
interface AgentStream {
  arrived(seq: number): Promise<number>
  close(): void
}

async function follow(routerUrl: string, agentId: string): Promise<AgentStream> {
  const times = new Map<number, number>()
  const waiting = new Map<number, (at: number) => void>()
  const ac = new AbortController()
  const res = await request(`${routerUrl}/v1/agents/${agentId}/events?after=0`, { signal: ac.signal, bodyTimeout: 0 })
  if (res.statusCode !== 200) throw new Error(`stream for ${agentId}: HTTP ${res.statusCode}`)
  let partial = ''
  res.body.setEncoding('utf8')
  res.body.on('data', (text: string) => {
    const at = performance.now()
    const lines = (partial + text).split('\n')
    partial = lines.pop() ?? ''
    for (const line of lines) {
      if (!line.startsWith('id:')) continue
      const seq = Number(line.slice(3).trim())
      times.set(seq, at)
      waiting.get(seq)?.(at)
      waiting.delete(seq)
    }
  })
  res.body.on('error', () => undefined)
  return {
    arrived: (seq) => {
      const at = times.get(seq)
      if (at !== undefined) return Promise.resolve(at)
      return new Promise((resolve, reject) => {
        const timer = setTimeout(() => reject(new Error(`event ${seq} did not reach ${agentId} within 5 s`)), 5000)
        waiting.set(seq, (t) => {
          clearTimeout(timer)
          resolve(t)
        })
      })
    },
    close: () => ac.abort(),
  }
}

async function postAs(url: string, body: unknown, headers: Record<string, string> = {}): Promise<{ status: number; json: Record<string, unknown> }> {
  const res = await request(url, { method: 'POST', headers: { 'content-type': 'application/json', ...headers }, body: JSON.stringify(body) })
  const text = await res.body.text()
  return { status: res.statusCode, json: text ? (JSON.parse(text) as Record<string, unknown>) : {} }
}

/** Per-stream and slowest-stream delays (ms, sorted) for `events` events sent to `agents` streams. */
async function fanOut(s: Setup, agents: number, events: number, tag: string): Promise<{ each: number[]; last: number[] }> {
  const urls = s.routers.map((r) => r.url)
  const streams: AgentStream[] = []
  try {
    for (let i = 0; i < agents; i++) {
      const url = urls[i % urls.length] as string
      const agentId = `${tag}-agent-${i}`
      const reg = await postAs(`${url}/v1/agents`, { agentId, engineId: `${tag}-engine-${i}`, role: 'decode', agentUrl: `http://127.0.0.1:${21000 + i}` })
      if (reg.status !== 200) throw new Error(`registering ${agentId}: HTTP ${reg.status} ${JSON.stringify(reg.json)}`)
      streams.push(await follow(url, agentId))
    }
    const sender = urls[0] as string
    const each: number[] = []
    const last: number[] = []
    for (let e = 0; e < events; e++) {
      // An engine to declare gone, registered on the sending router (unknown engines are a no-op).
      const ghost = `${tag}-ghost-${e}`
      await postAs(`${sender}/v1/agents`, { agentId: ghost, engineId: ghost, role: 'prefill', agentUrl: `http://127.0.0.1:${41000 + e}` })
      const sent = performance.now()
      const ft = await postAs(`${sender}/fault_tolerance/event`, { event_type: 'peer_gone', nodes: { engine_ids: [ghost] } }, { authorization: `Bearer ${ADMIN}` })
      const seq = ft.json.seq
      if (ft.status !== 202 || typeof seq !== 'number') throw new Error(`fault_tolerance/event: HTTP ${ft.status} ${JSON.stringify(ft.json)}`)
      const times = await Promise.all(streams.map((st) => st.arrived(seq)))
      const delays = times.map((at) => at - sent)
      each.push(...delays)
      last.push(Math.max(...delays))
    }
    return { each: each.sort((a, b) => a - b), last: last.sort((a, b) => a - b) }
  } finally {
    for (const st of streams) st.close()
  }
}

async function fanOutRows(setups: Setup[], agentCounts: number[], events: number): Promise<string[]> {
  const rows: string[] = []
  for (const n of agentCounts) {
    const base = { each: [] as number[], last: [] as number[] }
    for (const s of setups) {
      process.stderr.write(`fan-out to ${n} streams, ${s.label}…\n`)
      const r = await fanOut(s, n, events, `${s.key}${n}`)
      if (s.key === 'a') Object.assign(base, r)
      const vsA = s.key === 'a' ? '—' : `${ratio(percentile(r.last, 50), percentile(base.last, 50))} / ${ratio(percentile(r.last, 99), percentile(base.last, 99))}`
      rows.push(`| ${n} | ${s.label} | ${events} | ${f(percentile(r.each, 50))} / ${f(percentile(r.each, 99))} | ${f(percentile(r.last, 50))} / ${f(percentile(r.last, 99))} | ${vsA} |`)
    }
  }
  return rows
}

// ---- the run --------------------------------------------------------------------------------

export async function runRoutersBench(argv: string[]): Promise<void> {
  const { values } = parseArgs({
    args: argv,
    options: {
      quick: { type: 'boolean' },
      concurrency: { type: 'string' },
      seconds: { type: 'string' },
      requests: { type: 'string' },
      rounds: { type: 'string' },
      agents: { type: 'string' },
      events: { type: 'string' },
      help: { type: 'boolean', short: 'h' },
    },
  })
  if (values.help) {
    process.stdout.write(HELP)
    return
  }
  const quick = values.quick === true
  const concurrencies = list(values.concurrency, quick ? [4] : [16, 64])
  const seconds = Number(values.seconds ?? (quick ? 0.5 : 4))
  const maxRequests = Number(values.requests ?? (quick ? 100 : 5000))
  const rounds = Number(values.rounds ?? (quick ? 1 : 3))
  const agentCounts = list(values.agents, quick ? [3] : [10, 100])
  const events = Number(values.events ?? (quick ? 5 : 100))

  const version = redisVersion()
  if (!version) {
    process.stderr.write('error: redis-server not found (Debian: apt-get install redis-server); this bench compares routers on Redis with one in memory and cannot run without it\n')
    process.exitCode = 1
    return
  }
  const load = loadavg()[0] ?? NaN
  const dir = mkdtempSync(join(tmpdir(), 'handoff-bench-routers-'))
  const services: SpawnedService[] = []
  const start = async (args: string[]): Promise<SpawnedService> => {
    const s = await spawnService({ args })
    services.push(s)
    return s
  }
  let redis: Awaited<ReturnType<typeof startRedisServer>> | undefined
  try {
    redis = await startRedisServer()
    const sim = (role: string) => start(['sim', '--role', role, '--kv', 'none', '--log-level', 'warn'])
    const [p, d] = await Promise.all([sim('prefill'), sim('decode')])
    const instances = [
      { id: 'p0', role: 'prefill', url: p.url },
      { id: 'd0', role: 'decode', url: d.url },
    ]
    // Each setup on Redis gets its own key prefix: (b) and (c) do not see each other.
    const router = async (name: string, store: Record<string, unknown>): Promise<SpawnedService> => {
      const file = join(dir, `${name}.json`)
      writeFileSync(file, JSON.stringify({ port: 0, logLevel: 'warn', adminToken: ADMIN, instances, store }))
      return start(['router', '--config', file])
    }
    const redisStore = (prefix: string) => ({ kind: 'redis', url: redis?.url, prefix })
    const a = await router('a', { kind: 'memory' })
    const b = [await router('b0', redisStore('bench-b:')), await router('b1', redisStore('bench-b:'))]
    const c = await router('c', redisStore('bench-c:'))
    const pid = (s: SpawnedService): number => s.child.pid as number
    const setups: Setup[] = [
      { key: 'a', label: '(a) 1 router, memory', routers: [a], pids: [pid(a)], redisPid: undefined },
      { key: 'b', label: '(b) 2 routers, Redis', routers: b, pids: b.map(pid), redisPid: redis.pid },
      { key: 'c', label: '(c) 1 router, Redis', routers: [c], pids: [pid(c)], redisPid: redis.pid },
    ]

    const requestLines = await requestsTable({ p, d, setups, concurrencies, seconds, maxRequests, rounds })
    const fanLines = await fanOutRows(setups, agentCounts, events)
    const out = [
      `Machine: ${cpus().length} × ${cpus()[0]?.model ?? 'cpu'}, ${(totalmem() / 2 ** 30).toFixed(0)} GiB, Node ${process.version}, redis-server ${version}; 1-min load average ${f(load)} at start. Every process (bench client, routers, Redis, P, D) shares these cores.`,
      '',
      `Requests: 1 P + 1 D simulator (--kv none, zero delays), /v1/completions, max_tokens 8, not streamed; ${rounds} alternating rounds (rotating the setups' order) of ≤${maxRequests} requests / ${seconds} s per path per concurrency; (b) alternates requests between its two routers.`,
      '',
      '| concurrency | path | requests | req/s | p50 / p99 ms | added mean ms vs direct | req/s ÷ (a) | p50 / p99 ÷ (a) | CPU ms per req, routers / Redis | errors |',
      '| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |',
      ...requestLines,
      '',
      `Event fan-out: N fake agents (SSE clients) spread evenly over the setup's routers; ${events} peer_gone events sent to the first router with POST /fault_tolerance/event; ms from sending to a stream receiving the event.`,
      '',
      '| agents | setup | events | send → each stream p50 / p99 ms | send → last stream p50 / p99 ms | last stream p50 / p99 ÷ (a) |',
      '| ---: | --- | ---: | ---: | ---: | ---: |',
      ...fanLines,
      '',
    ]
    process.stdout.write(out.join('\n'))
  } finally {
    await Promise.all(services.map((s) => s.stop()))
    await redis?.stop()
    rmSync(dir, { recursive: true, force: true })
  }
}
