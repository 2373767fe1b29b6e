import type { Clock } from '../../common/clock.js'
import { errorWithDetails } from '../../common/coded-error.js'
import { LeaseTable } from '../../common/lease-table.js'
import type { AgentCallDetails } from '../../sim/src/agent-client.js'
import { simErrors } from '../../sim/src/errors.js'
import type { KvPull, KvTransport, KvTransportDeps, KvTransportFactory, RemoteKv } from '../../sim/src/kv-source.js'

/**
 * In-process stand-ins for the transfer agents of several simulators: leases in a
 * common/lease-table.ts per engine (read-done ends one, expiry frees its blocks), pulls copy
 * the prefiller's block bytes into the decoder's blocks without checking the lease (as an
 * agent with its deadline checks off would), so a late read really reads reused bytes.
 */
export class FakeKv {
  readonly #clock: Clock
  readonly #leaseMs: number
  readonly #engines = new Map<string, { deps: KvTransportDeps; leases: LeaseTable<readonly number[]> }>()
  /** Set to make every pull fail like the agent would (the blocks are freed at once). */
  failPulls: AgentCallDetails | undefined
  readonly pulls: { requestId: string; remote: RemoteKv }[] = []

  constructor(opts: { clock: Clock; leaseMs?: number }) {
    this.#clock = opts.clock
    this.#leaseMs = opts.leaseMs ?? 30_000
  }

  transport(): KvTransportFactory {
    return (deps) => this.#transport(deps)
  }

  #transport(deps: KvTransportDeps): KvTransport {
    const { pool, metrics } = deps
    const leases = new LeaseTable<readonly number[]>({
      clock: this.#clock,
      leaseMs: this.#leaseMs,
      onEnd: (lease, reason) => {
        pool.free(lease.value)
        if (reason === 'expired') metrics.kvExpired.inc(metrics.labels)
      },
    })
    leases.start()
    this.#engines.set(deps.engineId, { deps, leases })
    return {
      ready: true,
      peer: { host: '127.0.0.1', port: 7600 },
      get leases() {
        return leases.size
      },
      taintedBlocks: 0,
      lease: async (requestId, blocks) => {
        leases.pin(requestId, blocks)
        return (this.#clock.monotonic() + this.#leaseMs) / 1000
      },
      release: (requestId) => void leases.release(requestId),
      pull: async (job) => this.#pull(deps, job),
      close: async () => leases.stop(),
    }
  }

  async #pull(d: KvTransportDeps, job: KvPull): Promise<void> {
    this.pulls.push({ requestId: job.requestId, remote: job.remote })
    if (this.failPulls) {
      d.pool.free(job.localBlocks)
      throw errorWithDetails(simErrors, 'SIM_ERR_AGENT_CALL', `POST /v1/pulls: ${this.failPulls.agentCode}`, this.failPulls)
    }
    const p = this.#engines.get(job.remote.remoteEngineId)
    if (!p) throw new Error(`no engine ${job.remote.remoteEngineId}`)
    const from = p.deps.region
    const to = d.region
    job.remote.blockIds.slice(0, job.localBlocks.length).forEach((id, i) => {
      to.bytes.set(from.blockView(id), (job.localBlocks[i] as number) * to.blockBytes)
    })
    p.leases.readDone(job.remote.remoteRequestId)
  }
}
