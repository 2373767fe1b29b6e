// `handoff bench nixl [--quick]`: NIXL READ bandwidth and per-request latency between two
// processes on this machine, over UCX, for a grid of block sizes and batch sizes (descriptors
// per request), beside a memcpy baseline measured in the same run, for several UCX_TLS
// settings. Prints one JSON object per line.
//
// Each UCX_TLS variant gets a fresh target process and a fresh reader agent: UCX reads its
// environment when a backend (UCP context) is created.
import { fork, type ChildProcess } from 'node:child_process'
import { once } from 'node:events'
import { fileURLToPath } from 'node:url'
import {
  addressOf,
  createAgent,
  loadNixl,
  packDescriptors,
  type Descriptor,
  type NixlAgent,
  type NixlInfo,
} from '../native/index.js'

const KiB = 1024
const MiB = 1024 * KiB
const REGION = 64 * MiB
const TARGET_FLAG = '--nixl-bench-target'

export interface NixlBenchRow {
  bench: 'nixl'
  ucx_tls: string
  block_bytes: number
  batch: number
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

interface Plan {
  variants: string[]
  blocks: number[]
  batches: number[]
  /** Time spent per cell once warmed up, and a cap on requests. */
  cellMs: number
  maxIters: number
}

function plan(quick: boolean): Plan {
  return quick
    ? { variants: ['default', 'tcp'], blocks: [16 * KiB, 256 * KiB, 4 * MiB], batches: [1, 64, 1024], cellMs: 250, maxIters: 200 }
    : {
        variants: ['default', 'tcp', 'sm,tcp', 'cma,tcp'],
        blocks: [16 * KiB, 64 * KiB, 256 * KiB, MiB, 4 * MiB],
        batches: [1, 4, 16, 64, 256, 1024],
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

async function runCell(
  reader: NixlAgent,
  peer: string,
  local: Buffer,
  expected: Buffer,
  remoteBase: bigint,
  block: number,
  batch: number,
  p: Plan,
): Promise<Omit<NixlBenchRow, 'bench' | 'ucx_tls' | 'nixl_version' | 'plugin'>> {
  const localBase = addressOf(local)
  const ld: Descriptor[] = []
  const rd: Descriptor[] = []
  for (let i = 0; i < batch; i++) {
    ld.push({ addr: localBase + BigInt(i * block), len: block })
    rd.push({ addr: remoteBase + BigInt(i * block), len: block })
  }
  const lp = packDescriptors(ld)
  const rp = packDescriptors(rd)
  const bytes = block * batch
  local.fill(0, 0, bytes)
  await reader.read(peer, lp, rp, { timeoutMs: 30_000 }) // warm-up: connection, rkeys, caches
  const lat: number[] = []
  const start = process.hrtime.bigint()
  const budget = BigInt(p.cellMs) * 1_000_000n
  while (lat.length < p.maxIters && process.hrtime.bigint() - start < budget) {
    const t0 = process.hrtime.bigint()
    await reader.read(peer, lp, rp, { timeoutMs: 30_000 })
    lat.push(Number(process.hrtime.bigint() - t0) / 1000)
  }
  const elapsedS = Number(process.hrtime.bigint() - start) / 1e9
  const verified = local.subarray(0, bytes).equals(expected.subarray(0, bytes))

  // memcpy baseline over the same bytes and block layout, timed the same way.
  const src = expected
  const dst = Buffer.alloc(bytes) // zero-filled: page faults happen here, not in the timing
  let copies = 0
  const m0 = process.hrtime.bigint()
  while (copies < lat.length || process.hrtime.bigint() - m0 < budget / 4n) {
    for (let i = 0; i < batch; i++) src.copy(dst, i * block, i * block, (i + 1) * block)
    copies++
    if (copies > 100_000) break
  }
  const memS = Number(process.hrtime.bigint() - m0) / 1e9
  lat.sort((a, b) => a - b)
  return {
    block_bytes: block,
    batch,
    iters: lat.length,
    gbps: Number(((bytes * lat.length) / elapsedS / 1e9).toFixed(3)),
    lat_us_p50: percentile(lat, 50),
    lat_us_p99: percentile(lat, 99),
    memcpy_gbps: Number(((bytes * copies) / memS / 1e9).toFixed(3)),
    verified,
  }
}

/** Entry point of `handoff bench nixl [--quick]`. */
export async function runNixlBench(argv: string[]): Promise<void> {
  const p = plan(argv.includes('--quick'))
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
        await reader.registerMemory(local)
        const peer = await reader.loadRemoteMetadata(target.md)
        for (const block of p.blocks) {
          for (const batch of p.batches) {
            if (block * batch > REGION) continue
            const cell = await runCell(reader, peer, local, expected, target.addr, block, batch, p)
            const row: NixlBenchRow = { bench: 'nixl', ucx_tls: variant, ...cell, nixl_version: info.version, plugin: 'UCX' }
            process.stdout.write(`${JSON.stringify(row)}\n`)
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
