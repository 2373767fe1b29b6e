// `handoff bench agent [--quick]`: what the transfer agent adds to a KV handoff (issue #8).
// The bench process plays both engines: it creates two shared-memory KV regions, starts two
// `handoff agent` processes (P attached as prefiller, D as decoder) and, per handoff, leases
// blocks on P, pulls them on D with P's deadline, and waits for P's `lease_ended` event (the
// prefiller's engine told its blocks are free). In the same run, beside each cell, a NIXL
// agent in this process READs the same blocks of the same regions straight from a target
// process (no agent, no HTTP): the raw READ that `handoff bench nixl` measures.
import { fork, type ChildProcess } from 'node:child_process'
import { randomFillSync } from 'node:crypto'
import { once } from 'node:events'
import { cpus, totalmem } from 'node:os'
import { performance } from 'node:perf_hooks'
import { fileURLToPath } from 'node:url'
import { parseArgs } from 'node:util'
import { Agent, request, type Dispatcher } from 'undici'
import { spawnService, type SpawnedService } from '../common/spawn.js'
import {
  createAgent,
  loadNixl,
  mapSharedMemory,
  unlinkSharedMemory,
  type NixlAgent,
  type NixlInfo,
  type PreparedBlocks,
  type SharedMemory,
} from '../native/index.js'
import type { AgentAttached, AgentEvents, LeaseGranted, PullDone } from '../schemas/agent-api.js'
import { mean, percentile } from './load.js'
import { cpuSeconds } from './proc-stats.js'

const HELP = `usage: handoff bench agent [--quick] [--prompts 1024,4096] [--concurrency 1,64]
                            [--seconds S] [--rounds R] [--max-handoffs N] [--bytes-per-token B]
                            [--region-mib M]

The transfer agent's cost per KV handoff. Two \`handoff agent\` processes (P: prefiller,
D: decoder) over two shared-memory KV regions of --region-mib each; per handoff the bench
POSTs /v1/leases on P, POSTs /v1/pulls on D with P's deadline, and waits for P's lease_ended
event. Beside each cell, the same blocks READ directly with NIXL (prepared lists, as the agent
does) from a target process: the raw READ. Blocks are 16 tokens of --bytes-per-token bytes.
A cell whose concurrency × blocks does not fit the region runs at the concurrency that fits
(marked "capped"). Prints two markdown tables to stdout, progress to stderr.

  --quick            smoke run (1,024-token prompts at concurrency 1 and 8, 32 MiB regions)
  --prompts          prompt lengths in tokens (default 1024,4096)
  --concurrency      handoffs in flight (default 1,64)
  --seconds          measured time per cell and path (default 8), split into --rounds
  --rounds           alternating raw / agent rounds per cell (default 2)
  --max-handoffs     cap per cell, path and round (default 5000)
  --bytes-per-token  KV bytes per token in one region (default 4096: one layer-slice of an
                     8B model; the agent accepts at most 65536)
  --region-mib       size of each of the two regions (default 256)
`

const KiB = 1024
const MiB = 1024 * KiB
const BLOCK_TOKENS = 16
const TARGET_FLAG = '--agent-bench-target'

interface Options {
  prompts: number[]
  concurrency: number[]
  seconds: number
  rounds: number
  maxHandoffs: number
  bytesPerToken: number
  regionMiB: number
}

interface Cell {
  tokens: number
  blocks: number
  /** Requested concurrency, and what the region allows. */
  wanted: number
  concurrency: number
}

/** A flag's comma-separated positive numbers (integers where `integer`), or the fallback. */
function numbers(value: string | undefined, fallback: number[], name: string, integer = true): number[] {
  if (value === undefined) return fallback
  const out = value.split(',').map(Number)
  const bad = out.some((n) => !Number.isFinite(n) || n <= 0 || (integer && !Number.isInteger(n)))
  if (bad || out.length === 0) throw new Error(`--${name}: expected positive ${integer ? 'integers' : 'numbers'}, got '${value}'`)
  return out
}

function one(value: string | undefined, fallback: number, name: string, integer = true): number {
  const [n] = numbers(value, [fallback], name, integer)
  return n ?? fallback
}

function parseOptions(argv: string[]): Options | 'help' {
  const { values } = parseArgs({
    args: argv,
    options: {
      help: { type: 'boolean', short: 'h' },
      quick: { type: 'boolean' },
      prompts: { type: 'string' },
      concurrency: { type: 'string' },
      seconds: { type: 'string' },
      rounds: { type: 'string' },
      'max-handoffs': { type: 'string' },
      'bytes-per-token': { type: 'string' },
      'region-mib': { type: 'string' },
    },
  })
  if (values.help) return 'help'
  const quick = values.quick === true
  const o: Options = {
    prompts: numbers(values.prompts, quick ? [1024] : [1024, 4096], 'prompts'),
    concurrency: numbers(values.concurrency, quick ? [1, 8] : [1, 64], 'concurrency'),
    seconds: one(values.seconds, quick ? 1.5 : 8, 'seconds', false),
    rounds: one(values.rounds, quick ? 1 : 2, 'rounds'),
    maxHandoffs: one(values['max-handoffs'], quick ? 500 : 5000, 'max-handoffs'),
    bytesPerToken: one(values['bytes-per-token'], 4096, 'bytes-per-token'),
    regionMiB: one(values['region-mib'], quick ? 32 : 256, 'region-mib', false),
  }
  // The agent's attach schema bounds bytesPerToken to 8..65536 (schemas/agent-api.ts).
  if (o.bytesPerToken < 8 || o.bytesPerToken > 65536) {
    throw new Error('--bytes-per-token: from 8 to 65536 (the agent refuses more)')
  }
  return o
}

function cellsOf(o: Options, regionBlocks: number): Cell[] {
  const cells: Cell[] = []
  for (const tokens of o.prompts) {
    const blocks = Math.ceil(tokens / BLOCK_TOKENS)
    const fits = Math.floor(regionBlocks / blocks)
    if (fits < 1) throw new Error(`a ${tokens}-token prompt (${blocks} blocks) does not fit a ${o.regionMiB} MiB region`)
    for (const wanted of o.concurrency) cells.push({ tokens, blocks, wanted, concurrency: Math.min(wanted, fits) })
  }
  return cells
}

// Random bytes: every check compares the destination with this region itself.
function fill(buf: Uint8Array): void {
  for (let off = 0; off < buf.byteLength; off += 64 * MiB) randomFillSync(buf, off, Math.min(64 * MiB, buf.byteLength - off))
}

function log(line: string): void {
  process.stderr.write(`bench agent: ${line}\n`)
}

// ---------------------------------------------------------------------------------------
// Everything the run creates, released once (finally and on SIGINT/SIGTERM): the reader's
// NIXL agent before the target and the agents, the shared-memory names last.

class Resources {
  readonly services: SpawnedService[] = []
  readonly shmNames: string[] = []
  readonly maps: SharedMemory[] = []
  target: ChildProcess | undefined
  reader: NixlAgent | undefined
  http: Agent | undefined
  events: LeaseEvents | undefined
  #closing: Promise<void> | undefined

  close(): Promise<void> {
    this.#closing ??= (async () => {
      const quietly = async (f: () => unknown): Promise<void> => {
        try {
          await f()
        } catch {
          // Best effort: the rest must still be released.
        }
      }
      await quietly(() => this.events?.stop())
      await quietly(() => this.reader?.close())
      await quietly(() => (this.target ? stopChild(this.target) : undefined))
      await Promise.all(this.services.map((s) => quietly(() => s.stop())))
      await quietly(() => this.http?.close())
      for (const m of this.maps) await quietly(() => m.unmap())
      for (const name of this.shmNames) await quietly(() => unlinkSharedMemory(name))
    })()
    return this.#closing
  }
}

async function stopChild(child: ChildProcess): Promise<void> {
  if (child.exitCode !== null || child.signalCode !== null) return
  const exited = once(child, 'exit')
  if (child.connected) child.send('exit')
  else child.kill('SIGTERM')
  const timer = setTimeout(() => child.kill('SIGKILL'), 5000)
  await exited
  clearTimeout(timer)
}

// ---------------------------------------------------------------------------------------
// HTTP to the agents

async function call<T>(http: Dispatcher, url: string, method: 'GET' | 'POST' | 'DELETE', body?: unknown): Promise<{ status: number; body: T }> {
  const res = await request(url, {
    dispatcher: http,
    method,
    ...(body === undefined ? {} : { headers: { 'content-type': 'application/json' }, body: JSON.stringify(body) }),
  })
  const text = await res.body.text()
  return { status: res.statusCode, body: (text ? JSON.parse(text) : {}) as T }
}

function describe(r: { status: number; body: unknown }): string {
  const e = (r.body as { error?: { code?: string; message?: string } }).error
  return `HTTP ${r.status}${e ? ` ${e.code ?? ''}: ${e.message ?? ''}` : ''}`
}

/**
 * P's engine side of the events: one long poll, each `lease_ended` stamped when its answer
 * arrived and handed to whoever waits for that request id.
 */
class LeaseEvents {
  readonly #url: string
  readonly #http: Dispatcher
  readonly #stop = new AbortController()
  readonly #arrived = new Map<string, { at: number; reason: string }>()
  readonly #waiters = new Map<string, (e: { at: number; reason: string }) => void>()
  readonly #loop: Promise<void>
  #after = 0

  constructor(url: string, http: Dispatcher) {
    this.#url = url
    this.#http = http
    this.#loop = this.#run()
  }

  async #run(): Promise<void> {
    while (!this.#stop.signal.aborted) {
      try {
        const res = await request(`${this.#url}/v1/engine/events?after=${this.#after}&waitMs=1000`, { dispatcher: this.#http, signal: this.#stop.signal })
        const body = (await res.body.json()) as AgentEvents
        const at = performance.now()
        for (const e of body.events) {
          if (e.type !== 'lease_ended') continue
          const ev = { at, reason: e.reason }
          const waiter = this.#waiters.get(e.requestId)
          if (waiter) {
            this.#waiters.delete(e.requestId)
            waiter(ev)
          } else this.#arrived.set(e.requestId, ev)
        }
        this.#after = body.last
      } catch {
        if (this.#stop.signal.aborted) return
        await new Promise((r) => setTimeout(r, 50))
      }
    }
  }

  /** Resolves when P's lease_ended for `requestId` has reached this process. */
  wait(requestId: string, timeoutMs: number): Promise<{ at: number; reason: string }> {
    const early = this.#arrived.get(requestId)
    if (early) {
      this.#arrived.delete(requestId)
      return Promise.resolve(early)
    }
    return new Promise((resolve, reject) => {
      const timer = setTimeout(() => {
        this.#waiters.delete(requestId)
        reject(new Error(`no lease_ended for ${requestId} within ${timeoutMs} ms`))
      }, timeoutMs)
      this.#waiters.set(requestId, (e) => {
        clearTimeout(timer)
        resolve(e)
      })
    })
  }

  /** Ended leases nobody waited for (released after a failure) are dropped. */
  forget(requestId: string): void {
    this.#arrived.delete(requestId)
    this.#waiters.delete(requestId)
  }

  async stop(): Promise<void> {
    this.#stop.abort()
    await this.#loop
  }
}

// ---------------------------------------------------------------------------------------
// The agents' histograms (Prometheus text), for the part of a pull before its READ.

interface Histogram {
  sum: number
  count: number
  /** Cumulative counts by upper bound (seconds). */
  buckets: Array<[number, number]>
}

function parseHistogram(text: string, name: string): Histogram {
  const h: Histogram = { sum: 0, count: 0, buckets: [] }
  for (const line of text.split('\n')) {
    if (!line.startsWith(name)) continue
    const value = Number(line.slice(line.lastIndexOf(' ') + 1))
    const rest = line.slice(name.length)
    if (rest.startsWith('_sum')) h.sum = value
    else if (rest.startsWith('_count')) h.count = value
    else if (rest.startsWith('_bucket')) {
      const le = /le="([^"]+)"/.exec(rest)?.[1]
      if (le !== undefined) h.buckets.push([le === '+Inf' ? Number.POSITIVE_INFINITY : Number(le), value])
    }
  }
  return h
}

function histogramDelta(a: Histogram, b: Histogram): Histogram {
  return {
    sum: b.sum - a.sum,
    count: b.count - a.count,
    buckets: b.buckets.map(([le, n], i) => [le, n - (a.buckets[i]?.[1] ?? 0)]),
  }
}

/** The upper bound (ms) of the bucket holding quantile `q`. */
function bucketQuantileMs(h: Histogram, q: number): number {
  const rank = q * h.count
  for (const [le, n] of h.buckets) if (n >= rank) return le * 1000
  return Number.NaN
}

// ---------------------------------------------------------------------------------------
// Raw READ: a NIXL agent in this process reads P's region, registered by a target process.

async function targetMain(): Promise<void> {
  const name = process.env.HANDOFF_BENCH_SHM ?? ''
  const size = Number(process.env.HANDOFF_BENCH_SHM_BYTES)
  await loadNixl({ libDir: process.env.NIXL_LIB_DIR })
  const shm = mapSharedMemory(name, size)
  const agent = await createAgent(`bench-raw-p-${process.pid}`)
  await agent.createBackend('UCX', {})
  const reg = await agent.registerMemory(new Uint8Array(shm.buffer, 0, size))
  const md = await agent.localMetadata()
  process.send?.({ md: md.toString('base64'), addr: reg.addr.toString() })
  const exit = (): void => {
    void agent
      .close()
      .catch(() => undefined)
      .finally(() => process.exit(0))
  }
  process.on('message', exit)
  process.on('disconnect', exit)
}

interface RawReader {
  agent: NixlAgent
  peer: string
  local: PreparedBlocks
  remote: PreparedBlocks
}

async function startRaw(res: Resources, info: NixlInfo, pShm: string, dMap: SharedMemory, bytes: number, blockBytes: number): Promise<RawReader> {
  const self = fileURLToPath(import.meta.url)
  const child = fork(self, [TARGET_FLAG], {
    env: { ...process.env, NIXL_LIB_DIR: info.libDir, HANDOFF_BENCH_SHM: pShm, HANDOFF_BENCH_SHM_BYTES: String(bytes) },
    // From TS sources (tsx) the child needs the same loader; compiled JS does not.
    execArgv: self.endsWith('.ts') ? ['--import', 'tsx'] : [],
    stdio: ['ignore', 'ignore', 'inherit', 'ipc'],
  })
  res.target = child
  const ready = once(child, 'message') as Promise<[{ md: string; addr: string }]>
  const died = once(child, 'exit').then(() => {
    throw new Error('raw READ target exited before it was ready')
  })
  let timer: NodeJS.Timeout | undefined
  const timeout = new Promise<never>((_, reject) => {
    timer = setTimeout(() => reject(new Error('raw READ target not ready within 30 s')), 30_000)
  })
  const [msg] = await Promise.race([ready, died, timeout]).finally(() => clearTimeout(timer))
  const agent = await createAgent(`bench-raw-d-${process.pid}`)
  res.reader = agent
  await agent.createBackend('UCX', {})
  const reg = await agent.registerMemory(new Uint8Array(dMap.buffer, 0, bytes))
  const peer = await agent.loadRemoteMetadata(Buffer.from(msg.md, 'base64'))
  // Prepared once, as the agent prepares its region and its peer's (transfer-agent/src/pulls.ts).
  const local = await agent.prepareLocalBlocks(reg, blockBytes)
  const remote = await agent.prepareRemoteBlocks(peer, { addr: BigInt(msg.addr), len: bytes }, blockBytes)
  return { agent, peer, local, remote }
}

// ---------------------------------------------------------------------------------------
// One cell: `concurrency` workers, worker w owning blocks [w·n, (w+1)·n) on both sides.

interface RawResult {
  latMs: number[]
  nixlMs: number[]
  wallS: number
  bytes: number
  errors: number
  verified: boolean
}

interface Handoff {
  leaseMs: number
  pullMs: number
  readMs: number
  agentPullMs: number
  /** lease call sent → P's lease_ended received. */
  toldMs: number
  /** D's pull answer received → P's lease_ended received (negative: P heard first). */
  toldAfterAnswerMs: number
  e2eMs: number
}

interface AgentResult {
  handoffs: Handoff[]
  wallS: number
  bytes: number
  errors: number
  firstError: string | undefined
  verified: boolean
  beforeRead: Histogram
  /** CPU seconds of P, D and this process over the measured part. */
  cpuS: [number, number, number]
}

interface Ctx {
  opts: Options
  http: Agent
  p: SpawnedService
  d: SpawnedService
  pEngine: string
  pAttached: AgentAttached
  events: LeaseEvents
  raw: RawReader
  pView: Uint8Array
  dView: Uint8Array
  blockBytes: number
  stopping: () => boolean
  /** Request ids handed out so far. */
  seq: number
}

function blockIds(w: number, n: number): number[] {
  return Array.from({ length: n }, (_, i) => w * n + i)
}

/** Zeroes each worker's destination blocks; after `check`, compares them with the source's. */
function verifier(ctx: Ctx, cell: Cell): { check: () => boolean } {
  const len = cell.concurrency * cell.blocks * ctx.blockBytes
  ctx.dView.fill(0, 0, len)
  return { check: () => Buffer.from(ctx.dView.buffer, ctx.dView.byteOffset, len).equals(Buffer.from(ctx.pView.buffer, ctx.pView.byteOffset, len)) }
}

async function closedLoop(ctx: Ctx, cell: Cell, step: (w: number) => Promise<void>): Promise<number> {
  let issued = 0
  const start = performance.now()
  const deadline = start + (ctx.opts.seconds / ctx.opts.rounds) * 1000
  await Promise.all(
    Array.from({ length: cell.concurrency }, async (_, w) => {
      while (issued < ctx.opts.maxHandoffs && performance.now() < deadline && !ctx.stopping()) {
        issued++
        await step(w)
      }
    }),
  )
  return (performance.now() - start) / 1000
}

async function runRawCell(ctx: Ctx, cell: Cell): Promise<RawResult> {
  const { raw } = ctx
  const idx = Array.from({ length: cell.concurrency }, (_, w) => Int32Array.from(blockIds(w, cell.blocks)))
  const readOnce = (w: number): Promise<{ micros: number }> => {
    const i = idx[w] as Int32Array
    return raw.agent.readBlocks(raw.peer, raw.local, i, raw.remote, i, { timeoutMs: 30_000 })
  }
  const v = verifier(ctx, cell)
  await Promise.all(idx.map((_, w) => readOnce(w))) // warm-up, and the bytes to check
  const verified = v.check()
  const latMs: number[] = []
  const nixlMs: number[] = []
  let errors = 0
  const wallS = await closedLoop(ctx, cell, async (w) => {
    const t0 = performance.now()
    try {
      const r = await readOnce(w)
      latMs.push(performance.now() - t0)
      nixlMs.push(r.micros / 1000)
    } catch {
      errors++
    }
  })
  return { latMs, nixlMs, wallS, bytes: latMs.length * cell.blocks * ctx.blockBytes, errors, verified }
}

/** One handoff: lease on P, pull on D, P's lease_ended. Throws with a readable message. */
async function handoff(ctx: Ctx, w: number, n: number): Promise<Handoff> {
  const ids = blockIds(w, n)
  const rid = `bench-${process.pid}-${++ctx.seq}`
  const t0 = performance.now()
  const lease = await call<LeaseGranted>(ctx.http, `${ctx.p.url}/v1/leases`, 'POST', { requestId: rid, blockIds: ids })
  const t1 = performance.now()
  if (lease.status !== 201) throw new Error(`lease: ${describe(lease)}`)
  const ended = ctx.events.wait(rid, 10_000)
  ended.catch(() => undefined) // observed below, or abandoned when the pull fails
  let pull: { status: number; body: PullDone }
  try {
    pull = await call<PullDone>(ctx.http, `${ctx.d.url}/v1/pulls`, 'POST', {
      requestId: `d-${rid}`,
      remoteEngineId: ctx.pEngine,
      remoteRequestId: rid,
      remoteHost: ctx.pAttached.peerHost,
      remotePort: ctx.pAttached.peerPort,
      remoteBlockIds: ids,
      remoteBlocksExpiryTime: lease.body.expiresAt,
      localBlockIds: ids,
    })
    if (pull.status !== 200) throw new Error(`pull: ${describe(pull)}`)
  } catch (err) {
    // The blocks stay leased until expiry otherwise, and the next handoff on them would fail.
    ctx.events.forget(rid)
    await call(ctx.http, `${ctx.p.url}/v1/leases/${rid}`, 'DELETE').catch(() => undefined)
    throw err
  }
  const t2 = performance.now()
  const ev = await ended
  if (ev.reason !== 'read_done') throw new Error(`lease_ended for ${rid}: ${ev.reason}, not read_done`)
  return {
    leaseMs: t1 - t0,
    pullMs: t2 - t1,
    readMs: pull.body.readMicros / 1000,
    agentPullMs: pull.body.pullMicros / 1000,
    toldMs: ev.at - t0,
    toldAfterAnswerMs: ev.at - t2,
    e2eMs: Math.max(t2, ev.at) - t0,
  }
}

async function beforeReadHistogram(ctx: Ctx): Promise<Histogram> {
  const res = await request(`${ctx.d.url}/metrics`, { dispatcher: ctx.http })
  return parseHistogram(await res.body.text(), 'handoff_agent_pull_before_read_seconds')
}

async function runAgentCell(ctx: Ctx, cell: Cell): Promise<AgentResult> {
  const v = verifier(ctx, cell)
  await Promise.all(Array.from({ length: cell.concurrency }, (_, w) => handoff(ctx, w, cell.blocks))) // warm-up
  const verified = v.check()
  const handoffs: Handoff[] = []
  let errors = 0
  let firstError: string | undefined
  const h0 = await beforeReadHistogram(ctx)
  const cpu = (): number[] => [ctx.p.child.pid, ctx.d.child.pid].map((pid) => (pid === undefined ? Number.NaN : cpuSeconds(pid)))
  const self0 = process.cpuUsage()
  const cpu0 = cpu()
  const wallS = await closedLoop(ctx, cell, async (w) => {
    try {
      handoffs.push(await handoff(ctx, w, cell.blocks))
    } catch (err) {
      errors++
      firstError ??= (err as Error).message
    }
  })
  const self = process.cpuUsage(self0)
  const cpuS = [...cpu().map((c, i) => c - (cpu0[i] ?? 0)), (self.user + self.system) / 1e6] as [number, number, number]
  const beforeRead = histogramDelta(h0, await beforeReadHistogram(ctx))
  return { handoffs, wallS, bytes: handoffs.length * cell.blocks * ctx.blockBytes, errors, firstError, verified, beforeRead, cpuS }
}

function mergeRaw(a: RawResult, b: RawResult): RawResult {
  return {
    latMs: [...a.latMs, ...b.latMs],
    nixlMs: [...a.nixlMs, ...b.nixlMs],
    wallS: a.wallS + b.wallS,
    bytes: a.bytes + b.bytes,
    errors: a.errors + b.errors,
    verified: a.verified && b.verified,
  }
}

function mergeAgent(a: AgentResult, b: AgentResult): AgentResult {
  return {
    handoffs: [...a.handoffs, ...b.handoffs],
    wallS: a.wallS + b.wallS,
    bytes: a.bytes + b.bytes,
    errors: a.errors + b.errors,
    firstError: a.firstError ?? b.firstError,
    verified: a.verified && b.verified,
    beforeRead: {
      sum: a.beforeRead.sum + b.beforeRead.sum,
      count: a.beforeRead.count + b.beforeRead.count,
      buckets: a.beforeRead.buckets.map(([le, n], i) => [le, n + (b.beforeRead.buckets[i]?.[1] ?? 0)]),
    },
    cpuS: [a.cpuS[0] + b.cpuS[0], a.cpuS[1] + b.cpuS[1], a.cpuS[2] + b.cpuS[2]],
  }
}

// ---------------------------------------------------------------------------------------
// Report

const sorted = (xs: number[]): number[] => [...xs].sort((a, b) => a - b)

function ms(x: number): string {
  if (!Number.isFinite(x)) return '–'
  return Math.abs(x) >= 100 ? x.toFixed(0) : Math.abs(x) >= 10 ? x.toFixed(1) : x.toFixed(2)
}

function dist(xs: number[], ps: number[]): string {
  const s = sorted(xs)
  return ps.map((p) => ms(percentile(s, p))).join(' / ')
}

function sizeLabel(bytes: number): string {
  return bytes >= MiB ? `${+(bytes / MiB).toFixed(2)} MiB` : `${+(bytes / KiB).toFixed(1)} KiB`
}

function report(cells: Array<{ cell: Cell; raw: RawResult; agent: AgentResult }>, o: Options, info: NixlInfo, blockBytes: number): string {
  const gbps = (bytes: number, s: number): string => (s > 0 ? (bytes / s / 1e9).toFixed(2) : '–')
  const lines = [
    `Machine: ${cpus().length} × ${cpus()[0]?.model ?? 'cpu'}, ${(totalmem() / 2 ** 30).toFixed(0)} GiB, Node ${process.version}, NIXL ${info.version ?? '?'} (UCX plugin, default transports); ` +
      `blocks of ${BLOCK_TOKENS} tokens × ${o.bytesPerToken} B = ${sizeLabel(blockBytes)}; two ${o.regionMiB} MiB shm regions; ${o.rounds} alternating round(s) of ${+(o.seconds / o.rounds).toFixed(2)} s (≤ ${o.maxHandoffs} handoffs) per cell and path, each after a warm-up handoff per worker.`,
    '',
    '| prompt tokens | request | concurrency | handoffs | raw READ p50 / p90 / p99 / mean ms | handoff p50 / p90 / p99 / mean ms | handoff ÷ raw, p50 / mean | GB/s raw / via agent | verified | errors |',
    '| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | :---: | ---: |',
  ]
  for (const { cell, raw, agent } of cells) {
    const e2e = agent.handoffs.map((h) => h.e2eMs)
    const rawS = sorted(raw.latMs)
    const e2eS = sorted(e2e)
    const conc = cell.concurrency === cell.wanted ? `${cell.concurrency}` : `${cell.concurrency} (capped: region)`
    lines.push(
      `| ${cell.tokens} | ${cell.blocks} × ${sizeLabel(blockBytes)} = ${sizeLabel(cell.blocks * blockBytes)} | ${conc} | ${agent.handoffs.length} | ` +
        `${dist(raw.latMs, [50, 90, 99])} / ${ms(mean(raw.latMs))} | ${dist(e2e, [50, 90, 99])} / ${ms(mean(e2e))} | ` +
        `${(percentile(e2eS, 50) / percentile(rawS, 50)).toFixed(2)} / ${(mean(e2e) / mean(raw.latMs)).toFixed(2)} | ` +
        `${gbps(raw.bytes, raw.wallS)} / ${gbps(agent.bytes, agent.wallS)} | ${raw.verified && agent.verified ? 'yes' : 'NO'} | ${raw.errors + agent.errors} |`,
    )
  }
  lines.push(
    '',
    'Where a handoff goes (ms). Agent overhead = pull call (client) − NIXL READ time the agent reported; HTTP+JSON = pull call − the agent\'s own pullMicros; before READ = accept → READ posted (D\'s handoff_agent_pull_before_read_seconds, mean and p99 bucket bound); queued + after READ = pullMicros − READ − before READ (means: the native poll thread posts a batch of READs one by one, a CMA post being the copy itself, and settles them together after the batch, all outside NIXL\'s READ time); P told = P\'s lease_ended reaching the bench, relative to D\'s pull answer.',
    '',
    '| prompt tokens | concurrency | lease call p50 / p99 | pull call p50 / p99 | NIXL READ p50 / p99 raw, in agent | agent overhead p50 / p90 / p99 / mean | HTTP+JSON mean | before READ mean / p99 ≤ | queued + after READ mean | P told after D answered p50 / p99 | CPU ms per handoff P / D / bench |',
    '| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |',
  )
  for (const { cell, raw, agent } of cells) {
    const hs = agent.handoffs
    const over = hs.map((h) => h.pullMs - h.readMs)
    const http = mean(hs.map((h) => h.pullMs - h.agentPullMs))
    const before = agent.beforeRead.count > 0 ? (agent.beforeRead.sum / agent.beforeRead.count) * 1000 : Number.NaN
    const after = mean(hs.map((h) => h.agentPullMs - h.readMs)) - before
    lines.push(
      `| ${cell.tokens} | ${cell.concurrency} | ${dist(hs.map((h) => h.leaseMs), [50, 99])} | ${dist(hs.map((h) => h.pullMs), [50, 99])} | ` +
        `${dist(raw.nixlMs, [50, 99])}, ${dist(hs.map((h) => h.readMs), [50, 99])} | ${dist(over, [50, 90, 99])} / ${ms(mean(over))} | ${ms(http)} | ` +
        `${ms(before)} / ${ms(bucketQuantileMs(agent.beforeRead, 0.99))} | ${ms(after)} | ${dist(hs.map((h) => h.toldAfterAnswerMs), [50, 99])} | ` +
        `${agent.cpuS.map((c) => (hs.length > 0 ? ((c * 1000) / hs.length).toFixed(2) : '–')).join(' / ')} |`,
    )
  }
  for (const { cell, agent } of cells) {
    if (agent.firstError) lines.push('', `- ${cell.tokens} tokens × ${cell.concurrency}: ${agent.errors} failed handoffs, first: ${agent.firstError}`)
  }
  return `${lines.join('\n')}\n`
}

// ---------------------------------------------------------------------------------------

async function run(o: Options, info: NixlInfo, res: Resources, stopping: () => boolean): Promise<void> {
  const blockBytes = BLOCK_TOKENS * o.bytesPerToken
  const numBlocks = Math.floor((o.regionMiB * MiB) / blockBytes)
  const bytes = numBlocks * blockBytes
  const cells = cellsOf(o, numBlocks)
  const names = { p: `/handoff-bench-p-${process.pid}`, d: `/handoff-bench-d-${process.pid}` }
  res.shmNames.push(names.p, names.d)
  const pMap = mapSharedMemory(names.p, bytes, { create: true, exclusive: true })
  const dMap = mapSharedMemory(names.d, bytes, { create: true, exclusive: true })
  res.maps.push(pMap, dMap)
  const pView = new Uint8Array(pMap.buffer, 0, bytes)
  const dView = new Uint8Array(dMap.buffer, 0, bytes)
  fill(pView)
  log(`NIXL ${info.version ?? '?'}; two ${sizeLabel(bytes)} regions of ${numBlocks} × ${sizeLabel(blockBytes)} blocks; starting P and D agents`)

  const spawnAgent = async (): Promise<SpawnedService> => {
    const s = await spawnService({ args: ['agent', '--log-level', 'warn'] })
    res.services.push(s)
    return s
  }
  const [p, d] = await Promise.all([spawnAgent(), spawnAgent()])
  const http = new Agent({ connections: 256, keepAliveTimeout: 30_000, headersTimeout: 60_000, bodyTimeout: 60_000 })
  res.http = http
  const attach = async (s: SpawnedService, engineId: string, role: 'prefill' | 'decode', shmName: string): Promise<AgentAttached> => {
    const r = await call<AgentAttached>(http, `${s.url}/v1/engine/attach`, 'POST', { engineId, role, shmName, blockSize: BLOCK_TOKENS, bytesPerToken: o.bytesPerToken, numBlocks })
    if (r.status !== 200) throw new Error(`attach ${role}: ${describe(r)}\n${s.output()}`)
    return r.body
  }
  const pEngine = `bench-p-${process.pid}`
  const pAttached = await attach(p, pEngine, 'prefill', names.p)
  await attach(d, `bench-d-${process.pid}`, 'decode', names.d)
  const events = new LeaseEvents(p.url, http)
  res.events = events
  const raw = await startRaw(res, info, names.p, dMap, bytes, blockBytes)
  const ctx: Ctx = { opts: o, http, p, d, pEngine, pAttached, events, raw, pView, dView, blockBytes, stopping, seq: 0 }

  // The first pull handshakes and prepares P's region on D; keep that out of every cell.
  await handoff(ctx, 0, 1)
  const results: Array<{ cell: Cell; raw: RawResult; agent: AgentResult }> = []
  for (const cell of cells) {
    if (stopping()) return
    let rawResult: RawResult | undefined
    let agentResult: AgentResult | undefined
    // Alternating rounds, so drift on a shared machine hits both paths alike.
    for (let round = 1; round <= o.rounds && !stopping(); round++) {
      const label = `${cell.tokens} tokens (${cell.blocks} blocks) × ${cell.concurrency}, round ${round}/${o.rounds}`
      const r = await runRawCell(ctx, cell)
      log(`${label}: raw READ ${r.latMs.length} × p50 ${ms(percentile(sorted(r.latMs), 50))} ms`)
      const a = await runAgentCell(ctx, cell)
      log(`${label}: ${a.handoffs.length} handoffs, p50 ${ms(percentile(sorted(a.handoffs.map((h) => h.e2eMs)), 50))} ms, ${a.errors} errors`)
      rawResult = rawResult ? mergeRaw(rawResult, r) : r
      agentResult = agentResult ? mergeAgent(agentResult, a) : a
    }
    if (rawResult && agentResult) results.push({ cell, raw: rawResult, agent: agentResult })
  }
  process.stdout.write(report(results, o, info, blockBytes))
}

/** Entry point of `handoff bench agent`. */
export async function runAgentBench(argv: string[]): Promise<void> {
  const o = parseOptions(argv)
  if (o === 'help') {
    process.stdout.write(HELP)
    return
  }
  // Before any NIXL agent exists here or in a child (test/native/helpers.ts says why).
  process.env.UCX_MEM_MMAP_HOOK_MODE ??= 'reloc'
  const info = await loadNixl({ libDir: process.env.NIXL_LIB_DIR })
  const res = new Resources()
  let stopped = false
  const onSignal = (signal: NodeJS.Signals): void => {
    if (stopped) return
    stopped = true
    log(`${signal}: stopping the agents and removing the regions`)
    void res.close().finally(() => process.exit(130))
  }
  process.on('SIGINT', onSignal)
  process.on('SIGTERM', onSignal)
  try {
    await run(o, info, res, () => stopped)
  } finally {
    await res.close()
    process.off('SIGINT', onSignal)
    process.off('SIGTERM', onSignal)
  }
}

// Started as the raw READ target by startRaw().
if (process.argv.includes(TARGET_FLAG) && process.argv[1] === fileURLToPath(import.meta.url)) {
  targetMain().catch((err: unknown) => {
    process.stderr.write(`bench agent target: ${err instanceof Error ? err.message : String(err)}\n`)
    process.exit(1)
  })
}
