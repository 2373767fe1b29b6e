import type { Clock } from '../../common/clock.js'
import type { Random } from '../../common/random.js'
import type { SimConfig } from '../../schemas/sim-config.js'
import type { BlockPool } from './block-pool.js'
import type { SimEngine } from './engine.js'
import type { FaultState } from './faults.js'
import type { KvEventPublisher } from './kv-events.js'
import type { KvRegion } from './kv-region.js'
import type { KvTransport } from './kv-source.js'
import type { SimMetrics } from './metrics.js'
import type { RequestLog } from './request-log.js'
import type { SeqSlots } from './seq-slots.js'

/** Everything the route plugins share, built once by buildApp and passed as plugin options. */
export interface SimContext {
  readonly config: Readonly<SimConfig>
  readonly clock: Clock
  readonly random: Random
  /**
   * The data-parallel ranks behind this port, in rank order (one without data parallel, or
   * with --data-parallel-rank): each request is served by one of them.
   */
  readonly engines: readonly SimEngine[]
  /** The rank a request without X-data-parallel-rank goes to next (round robin). */
  nextRank: number
  readonly region: KvRegion
  readonly pool: BlockPool
  /** --kv-events-config: the pool's events publisher, once open (onReady); else undefined. */
  kvEvents: KvEventPublisher | undefined
  /** `--kv agent` only: the link to the transfer agent. */
  readonly kv: KvTransport | undefined
  readonly faults: FaultState
  readonly metrics: SimMetrics
  readonly requests: RequestLog
  /** X-Request-Id values of the completions in flight (older vLLM refused a reused id). */
  readonly inFlightIds: Set<string>
  /** max_num_seqs: completions running at once; the rest wait their turn. */
  readonly seqs: SeqSlots
  /** Aborted when the app closes: stalls and delays end instead of holding shutdown. */
  readonly shutdown: AbortSignal
  /** process.exit in production; a recorder in tests (crashAfter). */
  readonly exit: (code: number) => void
}
