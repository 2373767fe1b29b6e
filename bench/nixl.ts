// `handoff bench nixl [--quick]`: NIXL READ bandwidth and per-request latency between two
// processes on this machine, over UCX, for a grid of block sizes and batch sizes (descriptors
// per request), each READ built per request (create_xfer_req) and, for batches, from lists
// prepared once (prep_xfer_dlist + make_xfer_req by block index), beside a memcpy baseline
// measured in the same run, for several UCX_TLS settings. Prints one JSON object per line.
//
// Each UCX_TLS variant gets a fresh target process and a fresh reader agent: UCX reads its
// environment when a backend (UCP context) is created.
import { fork, type ChildProcess } from 'node:child_process'
import { once } from 'node:events'
import { fileURLToPath } from 'node:url'
import { parseArgs } from 'node:util'
import {
  createAgent,
  loadNixl,
  packDescriptors,
  type Descriptor,
  type NixlAgent,
  type NixlInfo,
  type PreparedBlocks,
  type Registration,
} from '../native/index.js'

const KiB = 1024
const MiB = 1024 * KiB
const REGION = 64 * MiB
const TARGET_FLAG = '--nixl-bench-target'

export interface NixlBenchRow {
  bench: 'nixl'
  /** 'read': NIXL READs; 'memcpy': the same bytes and layout copied in this process. */
  op: 'read' | 'memcpy'
  ucx_tls: string
  block_bytes: number
  batch: number
  /** READ made from prepared descriptor lists (make_xfer_req) instead of create_xfer_req. */
  prepared: boolean
  iters: number
  /** READ bandwidth, 1e9 bytes per second, wall time over all requests of the cell. */
  gbps: number
  /** Per-request latency seen by JS (read() call to settle), µs. */
  lat_us_p50: number
  lat_us_p99: number
  /** memcpy of the same bytes in this process, same layout, 1e9 bytes per second. */
  memcpy_gbps: number
  verified: boolean
  nixl_version: string | null
  plugin: string
}

interface Cell {
  block: number
  batch: number
  prepared: boolean
}

interface Plan {
  variants: string[]
  cells: Cell[]
  /** Time spent per cell once warmed up, and a cap on requests. */
  cellMs: number
  maxIters: number
}

function grid(blocks: number[], batches: number[]): Cell[] {
  const cells: Cell[] = []
  for (const block of blocks) {
    for (const batch of batches) {
      if (block * batch > REGION) continue
      cells.push({ block, batch, prepared: false })
      // A prepared list only pays off with several blocks per request.
      if (batch > 1) cells.push({ block, batch, prepared: true })
    }
  }
  return cells
}

// The rows the KV path cares about, in every plan: a 16 MiB request as 1,024 × 16 KiB blocks
// (prepared and not) beside the same bytes as one 16 MiB READ.
const KV_CELLS: Cell[] = [
  { block: 16 * MiB, batch: 1, prepared: false },
  { block: 16 * KiB, batch: 1024, prepared: false },
  { block: 16 * KiB, batch: 1024, prepared: true },
]

function plan(quick: boolean): Plan {
  return quick
    ? {
        variants: ['default', 'tcp'],
        cells: [...KV_CELLS, ...grid([16 * KiB, 256 * KiB], [1, 64])],
        cellMs: 250,
        maxIters: 200,
      }
    : {
        variants: ['default', 'tcp', 'sm,tcp', 'cma,tcp'],
        cells: [...KV_CELLS, ...grid([16 * KiB, 64 * KiB, 256 * KiB, MiB, 4 * MiB], [1, 4, 16, 64, 256, 1024])],
        cellMs: 1000,
        maxIters: 2000,
      }
}

// Deterministic bytes, so the reader can check what it read without a second copy.
function fill(buf: Buffer, seed: number): void {
  const words = new Uint32Array(buf.buffer, buf.byteOffset, buf.byteLength >>> 2)
  let x = seed >>> 0 || 1
  for (let i = 0; i < words.length; i++) {
    x ^= x << 13
    x ^= x >>> 17
    x ^= x << 5
    words[i] = x >>> 0
  }
}

function percentile(sorted: number[], p: number): number {
  if (sorted.length === 0) return 0
  const i = Math.min(sorted.length - 1, Math.floor((p / 100) * sorted.length))
  return Math.round(sorted[i] ?? 0)
}

// ---------------------------------------------------------------------------------------
// Target process: owns and registers the region, serves the reader until told to exit.

async function targetMain(): Promise<void> {
  const info = await loadNixl({ libDir: process.env.NIXL_LIB_DIR, python: null })
  const agent = await createAgent(`bench-target-${process.pid}`)
  await agent.createBackend('UCX', {})
  const region = Buffer.allocUnsafeSlow(REGION)
  fill(region, 7)
  const reg = await agent.registerMemory(region)
  const md = await agent.localMetadata()
  process.send?.({ md: md.toString('base64'), addr: reg.addr.toString(), version: info.version })
  process.on('message', () => {
    void agent.close().finally(() => process.exit(0))
  })
  process.on('disconnect', () => process.exit(0))
}

// ---------------------------------------------------------------------------------------
// Reader side

interface TargetHandle {
  child: ChildProcess
  md: Buffer
  addr: bigint
}

async function startTarget(info: NixlInfo, ucxTls: string): Promise<TargetHandle> {
  const self = fileURLToPath(import.meta.url)
  const env: NodeJS.ProcessEnv = { ...process.env, NIXL_LIB_DIR: info.libDir }
  if (ucxTls === 'default') delete env.UCX_TLS
  else env.UCX_TLS = ucxTls
  // From TS sources (tsx, development) the child needs the same loader; compiled JS does not.
  const child = fork(self, [TARGET_FLAG], {
    env,
    execArgv: self.endsWith('.ts') ? ['--import', 'tsx'] : [],
    stdio: ['ignore', 'ignore', 'inherit', 'ipc'],
  })
  const ready = once(child, 'message') as Promise<[{ md: string; addr: string }]>
  const died = once(child, 'exit').then(() => {
    throw new Error('bench target exited before it was ready')
  })
  let timer: NodeJS.Timeout | undefined
  const timeout = new Promise<never>((_, reject) => {
    timer = setTimeout(() => reject(new Error('bench target not ready within 30 s')), 30_000)
  })
  try {
    const [msg] = await Promise.race([ready, died, timeout])
    return { child, md: Buffer.from(msg.md, 'base64'), addr: BigInt(msg.addr) }
  } catch (err) {
    child.kill('SIGKILL')
    throw err
  } finally {
    clearTimeout(timer)
  }
}

async function stopTarget(t: TargetHandle): Promise<void> {
  if (t.child.exitCode !== null || t.child.signalCode !== null) return
  const exited = once(t.child, 'exit')
  t.child.send('exit')
  const timer = setTimeout(() => t.child.kill('SIGKILL'), 5000)
  await exited
  clearTimeout(timer)
}

interface Lists {
  local: PreparedBlocks
  remote: PreparedBlocks
}

async function runCell(
  reader: NixlAgent,
  peer: string,
  local: Buffer,
  reg: Registration,
  expected: Buffer,
  remoteBase: bigint,
  cell: Cell,
  p: Plan,
  lists: (block: number) => Promise<Lists>,
): Promise<{ read: CellResult; memcpy: CellResult }> {
  const { block, batch } = cell
  const bytes = block * batch
  let readOnce: () => Promise<unknown>
  if (cell.prepared) {
    const { local: l, remote: r } = await lists(block)
    const idx = Int32Array.from({ length: batch }, (_, i) => i)
    readOnce = () => reader.readBlocks(peer, l, idx, r, idx, { timeoutMs: 30_000 })
  } else {
    const ld: Descriptor[] = []
    const rd: Descriptor[] = []
    for (let i = 0; i < batch; i++) {
      ld.push(reg.slice(i * block, block))
      rd.push({ addr: remoteBase + BigInt(i * block), len: block })
    }
    const lp = packDescriptors(ld)
    const rp = packDescriptors(rd)
    readOnce = () => reader.read(peer, lp, rp, { timeoutMs: 30_000 })
  }
  local.fill(0, 0, bytes)
  await readOnce() // warm-up: connection, rkeys, caches
  const lat: number[] = []
  const start = process.hrtime.bigint()
  const budget = BigInt(p.cellMs) * 1_000_000n
  while (lat.length < p.maxIters && process.hrtime.bigint() - start < budget) {
    const t0 = process.hrtime.bigint()
    await readOnce()
    lat.push(Number(process.hrtime.bigint() - t0) / 1000)
  }
  const elapsedS = Number(process.hrtime.bigint() - start) / 1e9
  const verified = local.subarray(0, bytes).equals(expected.subarray(0, bytes))

  // memcpy baseline over the same bytes and block layout, timed the same way.
  const src = expected
  const dst = Buffer.alloc(bytes) // zero-filled: page faults happen here, not in the timing
  const mlat: number[] = []
  const m0 = process.hrtime.bigint()
  while (mlat.length < Math.max(lat.length, 1) || process.hrtime.bigint() - m0 < budget / 4n) {
    const t0 = process.hrtime.bigint()
    for (let i = 0; i < batch; i++) src.copy(dst, i * block, i * block, (i + 1) * block)
    mlat.push(Number(process.hrtime.bigint() - t0) / 1000)
    if (mlat.length > 100_000) break
  }
  const memS = Number(process.hrtime.bigint() - m0) / 1e9
  lat.sort((a, b) => a - b)
  mlat.sort((a, b) => a - b)
  const memcpyGbps = Number(((bytes * mlat.length) / memS / 1e9).toFixed(3))
  return {
    read: {
      block_bytes: block,
      batch,
      prepared: cell.prepared,
      iters: lat.length,
      gbps: Number(((bytes * lat.length) / elapsedS / 1e9).toFixed(3)),
      lat_us_p50: percentile(lat, 50),
      lat_us_p99: percentile(lat, 99),
      memcpy_gbps: memcpyGbps,
      verified,
    },
    memcpy: {
      block_bytes: block,
      batch,
      prepared: false,
      iters: mlat.length,
      gbps: memcpyGbps,
      lat_us_p50: percentile(mlat, 50),
      lat_us_p99: percentile(mlat, 99),
      memcpy_gbps: memcpyGbps,
      verified: dst.equals(src.subarray(0, bytes)),
    },
  }
}

type CellResult = Omit<NixlBenchRow, 'bench' | 'op' | 'ucx_tls' | 'nixl_version' | 'plugin'>

/** Entry point of `handoff bench nixl [--quick]`. */
export async function runNixlBench(argv: string[]): Promise<void> {
  // Strict: an unknown flag is an error rather than a full run (which takes minutes).
  const { values } = parseArgs({ args: argv, options: { quick: { type: 'boolean' }, help: { type: 'boolean', short: 'h' } } })
  if (values.help) {
    process.stdout.write(
      'usage: handoff bench nixl [--quick]\n\nNIXL READs between two local processes (UCX, per UCX_TLS variant) against memcpy, over a grid of block sizes and batches;\none JSON line per cell on stdout, every byte verified. --quick: 2 variants and a small grid.\n',
    )
    return
  }
  const p = plan(values.quick === true)
  const info = await loadNixl({ libDir: process.env.NIXL_LIB_DIR })
  process.stderr.write(`bench nixl: NIXL ${info.version ?? '?'} from ${info.path}\n`)
  const expected = Buffer.allocUnsafeSlow(REGION)
  fill(expected, 7)
  const local = Buffer.alloc(REGION)
  const original = process.env.UCX_TLS
  try {
    for (const variant of p.variants) {
      // UCX reads UCX_TLS when the reader's backend is created below.
      if (variant === 'default') delete process.env.UCX_TLS
      else process.env.UCX_TLS = variant
      const target = await startTarget(info, variant)
      const reader = await createAgent(`bench-reader-${process.pid}-${variant.replace(/\W/g, '_')}`)
      try {
        await reader.createBackend('UCX', {})
        const reg = await reader.registerMemory(local)
        const peer = await reader.loadRemoteMetadata(target.md)
        // Prepared once per block size and peer, as the transfer agent prepares its KV region.
        const prepared = new Map<number, Lists>()
        const lists = async (block: number): Promise<Lists> => {
          let l = prepared.get(block)
          if (!l) {
            l = {
              local: await reader.prepareLocalBlocks(reg, block),
              remote: await reader.prepareRemoteBlocks(peer, { addr: target.addr, len: REGION }, block),
            }
            prepared.set(block, l)
          }
          return l
        }
        for (const cell of p.cells) {
          const out = await runCell(reader, peer, local, reg, expected, target.addr, cell, p, lists)
          const common = { bench: 'nixl' as const, ucx_tls: variant, nixl_version: info.version, plugin: 'UCX' }
          process.stdout.write(`${JSON.stringify({ ...common, op: 'read', ...out.read } satisfies NixlBenchRow)}\n`)
          // memcpy rows once (they do not depend on UCX_TLS), for the KV cells.
          if (variant === p.variants[0] && !cell.prepared && KV_CELLS.some((k) => k.block === cell.block && k.batch === cell.batch)) {
            process.stdout.write(`${JSON.stringify({ ...common, op: 'memcpy', ucx_tls: '-', ...out.memcpy } satisfies NixlBenchRow)}\n`)
          }
        }
      } finally {
        await reader.close()
        await stopTarget(target)
      }
    }
  } finally {
    if (original === undefined) delete process.env.UCX_TLS
    else process.env.UCX_TLS = original
  }
}

// Started as the target child by startTarget().
if (process.argv.includes(TARGET_FLAG) && process.argv[1] === fileURLToPath(import.meta.url)) {
  targetMain().catch((err: unknown) => {
    process.stderr.write(`bench nixl target: ${err instanceof Error ? err.message : String(err)}\n`)
    process.exit(1)
  })
}
