import { ScrapedEngine } from '../../bench/engine-metrics.js'
import { kvEventsConfigArg, kvEventsEndpoints, type KvEventsEndpoints } from '../../bench/vllm-engine.js'
import { spawnService, type SpawnedService } from '../../common/spawn.js'
import type { Teardown } from './cluster.js'

/**
 * The simulator as a drop-in for a real vLLM engine in test/vllm/ (the same surface as
 * bench/vllm-engine.ts VllmEngine): the same cases run against both, so a difference between
 * them is a simulator bug. Restarts at the same port with a new engine_id, as vLLM does.
 */
export class SimEngine extends ScrapedEngine {
  #service: SpawnedService | undefined
  #port = 0

  private constructor(
    readonly role: 'prefill' | 'decode',
    readonly args: string[],
    /** Where it publishes KV events (as VllmEngine's), the same after a restart. */
    readonly kvEvents: KvEventsEndpoints | undefined,
  ) {
    super()
  }

  static async start(t: Teardown, role: 'prefill' | 'decode', args: string[], opts: { kvEvents?: boolean } = {}): Promise<SimEngine> {
    const e = new SimEngine(role, args, opts.kvEvents ? await kvEventsEndpoints() : undefined)
    t.teardown(() => e.stop())
    await e.launch()
    return e
  }

  get url(): string {
    if (!this.#service) throw new Error(`the ${this.role} simulator is not running`)
    return this.#service.url
  }

  get name(): string {
    return this.role
  }

  /** (Re)starts the simulator at this engine's port: a restart gets a new engine_id. */
  async launch(): Promise<void> {
    this.#service = await spawnService({ args: ['sim', '--role', this.role, '--port', String(this.#port), '--log-level', 'info', ...this.args, ...(this.kvEvents ? ['--kv-events-config', kvEventsConfigArg(this.kvEvents)] : [])] })
    this.#port = Number(new URL(this.#service.url).port)
  }

  signal(sig: NodeJS.Signals): void {
    try {
      this.#service?.child.kill(sig)
    } catch {
      // already gone
    }
  }

  async stop(): Promise<void> {
    const s = this.#service
    if (!s || s.child.exitCode !== null || s.child.signalCode !== null) return
    s.child.kill('SIGCONT')
    await s.stop()
  }

  tail(): string {
    return this.#service?.output() ?? ''
  }
}
