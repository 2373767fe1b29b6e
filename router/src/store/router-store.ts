import { randomUUID } from 'node:crypto'
import type { Clock } from '../../../common/clock.js'
import type { RouterConfig } from '../../../schemas/router-config.js'
import type { AgentDirectory } from '../events/agent-directory.js'
import type { LoggedEvent } from '../events/event-log.js'
import type { StreamPresence } from '../events/router-events.js'
import type { LeaseLedger, LeaseRecord } from '../leases/ledger.js'
import { MemoryLeaseLedger, type MemoryLeaseLedgerOptions } from '../leases/memory-ledger.js'
import type { RemoteInflight } from '../topology/drainer.js'
import type { TopologyRegistry } from '../topology/registry.js'
import type { StoreLogger, StoreState } from './store-state.js'
import type { StoreConnectionMetrics } from './connection.js'
import { type EventStore, MemoryEventStore } from './event-store.js'
import { type Leadership, soleLeader } from './leader.js'

/**
 * Where a router keeps what it shares (config `store`): the event log, the lease records,
 * the topology and who probes. `memory` is this process alone; `redis` is several routers on
 * one Redis (docs/several-routers.md). app.ts builds the router on this and does not care
 * which one it got.
 */
export interface RouterStore {
  readonly kind: RouterConfig['store']['kind']
  /** This router replica's id (a new one per process). */
  readonly routerId: string
  readonly events: EventStore
  /** Who probes: this router alone (memory), or the holder of the leader lock. */
  readonly leadership: Leadership
  /** `degraded` while Redis is unreachable (always `ok` in memory). */
  readonly state: StoreState
  onChange(listener: (state: StoreState) => void): () => void
  /** The lease ledger: memory, or memory mirrored to Redis. */
  ledger(opts: Omit<MemoryLeaseLedgerOptions, 'clock'>): LeaseLedger
  /**
   * Shares this router's registry and agent directory with the other routers (a no-op in
   * memory); returns where the agents' streams are held.
   */
  share(parts: { registry: TopologyRegistry; agents: AgentDirectory }): Promise<SharedParts | undefined>
  /** The leader's duty: routers that stopped renewing their membership, once each. */
  onRouterGone(listener: (routerId: string, unread: readonly LeaseRecord[]) => void): void
  close(): Promise<void>
}

export interface SharedParts extends StreamPresence {
  opened(agentId: string): void
  closed(agentId: string): void
  remoteInflight(instanceId: string): Promise<RemoteInflight>
  /** The prober leader shares all its verdicts (after its first round as leader). */
  publishVerdicts(): void
}

export interface RouterStoreDeps {
  config: RouterConfig
  clock: Clock
  logger: StoreLogger & { child?: unknown }
  /** This router's URL, shown to the others (GET /topology). */
  url?: string
  onDelivered?: (event: LoggedEvent, ms: number) => void
  /** The Redis log was replaced (restarted empty): agents must start over. */
  onEventLogReset?: () => void
  metrics?: StoreConnectionMetrics
}

const OK: StoreState = Object.freeze({ state: 'ok' as const, since: 0 })

export async function openRouterStore(deps: RouterStoreDeps): Promise<RouterStore> {
  const { config, clock } = deps
  if (config.store.kind === 'memory') {
    deps.metrics?.up.set(1)
    const leadership = soleLeader()
    await leadership.start()
    return {
      kind: 'memory',
      routerId: randomUUID(),
      events: new MemoryEventStore({ clock, retention: config.events.retention, deliveryEntries: config.events.deliveryEntries, ...(deps.onDelivered ? { onDelivered: deps.onDelivered } : {}) }),
      leadership,
      state: OK,
      onChange: () => () => {},
      ledger: (opts) => new MemoryLeaseLedger({ clock, ...opts }),
      share: async () => undefined,
      onRouterGone: () => {},
      close: async () => {
        await leadership.stop()
      },
    }
  }
  // Redis (and ioredis) load only for a router that uses it.
  const { openRedisStore } = await import('./redis-store.js')
  return openRedisStore(deps)
}

/**
 * Whether `err` is Redis being unreachable (ioredis: no connection, a command timed out, the
 * offline queue is off): a control write fails with RTR_ERR_STORE_UNAVAILABLE, not a 500.
 */
export function isStoreError(err: unknown): boolean {
  if (!(err instanceof Error)) return false
  if (err.name === 'MaxRetriesPerRequestError') return true
  return /Connection is closed|Stream isn't writeable|Command timed out|ECONNREFUSED|ECONNRESET|ETIMEDOUT|EPIPE/.test(err.message)
}
