import type { FastifyBaseLogger } from 'fastify'
import type { Counter, Gauge } from 'prom-client'
import type { RouterConfig } from '../../../schemas/router-config.js'
import type { TopologyRegistry } from '../topology/registry.js'
import { KvEventFeed } from './kv-event-feed.js'
import { PrefixIndex } from './prefix-index.js'

/*
 * The router's prefix index of every engine that publishes KV events (issue 39 part 2): one
 * feed per instance with `kvEvents` in its config, keyed by the instance id, kept in step
 * with the topology.
 * - An instance added (config, autoscaler, discovery) with `kvEvents` gets a feed; removed,
 *   its feed closes and its blocks go.
 * - A new engine_id at the instance (the engine restarted) purges its blocks: a restarted
 *   engine holds nothing, whether or not its feed saw the publisher start over.
 * - Bounded (config.kvIndex): blocks per engine, engines; the blocks the per-engine bound drops
 *   are counted (handoff_router_kv_index_evicted_blocks_total).
 * Data-parallel ranks past 0 publish on further ports (vLLM's offset_endpoint_port); only rank
 * 0's endpoint, the one configured, is followed for now.
 */

export interface KvIndexerMetrics {
  blocks: Gauge<'instance'>
  batches: Counter<'instance'>
  /** The index of an instance purged, by reason: gap, unreadable, restart, engine_id, removed. */
  purges: Counter<'reason'>
  /** Blocks dropped to keep an engine within kvIndex.maxBlocksPerEngine. */
  evicted: Counter
  /** Blocks announced but not indexed: their parent unknown, or keyed by more than their tokens. */
  unindexed: Counter
}

export interface KvIndexerOptions {
  registry: TopologyRegistry
  config: RouterConfig['kvIndex']
  log: FastifyBaseLogger
  /** The router's hash seed (random per process; routers need not agree). */
  seed: number
  metrics?: KvIndexerMetrics
}

export class KvIndexer {
  readonly index: PrefixIndex
  readonly #o: KvIndexerOptions
  readonly #feeds = new Map<string, Promise<KvEventFeed | undefined>>()
  readonly #unsubscribe: () => void
  #closed = false

  constructor(o: KvIndexerOptions) {
    this.#o = o
    this.index = new PrefixIndex({ seed: o.seed, maxBlocksPerEngine: o.config.maxBlocksPerEngine, maxEngines: o.config.maxEngines })
    this.#unsubscribe = o.registry.subscribe((change) => {
      if (change.type === 'added') this.#follow(change.instanceId)
      else if (change.type === 'removed') this.#forget(change.instanceId, 'removed')
      else if (change.type === 'engine_id_changed') this.#purge(change.instanceId, 'engine_id')
    })
    for (const i of o.registry.snapshot().instances) this.#follow(i.id)
  }

  /** Instances followed now. */
  get following(): string[] {
    return [...this.#feeds.keys()]
  }

  /** The feed of an instance, once open (tests, /topology). */
  async feed(instanceId: string): Promise<KvEventFeed | undefined> {
    return this.#feeds.get(instanceId)
  }

  #follow(instanceId: string): void {
    const source = this.#o.registry.describe(instanceId)?.kvEvents
    if (!source || this.#closed || this.#feeds.has(instanceId)) return
    const { log, metrics } = this.#o
    const opening = KvEventFeed.open({
      key: instanceId,
      endpoint: source.endpoint,
      replayEndpoint: source.replayEndpoint,
      ...(source.topic !== undefined ? { topic: source.topic } : {}),
      index: this.index,
      log,
      replayTimeoutMs: this.#o.config.replayTimeoutMs,
      onApplied: (applied) => {
        metrics?.batches.inc({ instance: instanceId })
        if (applied.evicted > 0) metrics?.evicted.inc(applied.evicted)
        if (applied.orphaned + applied.keyed > 0) metrics?.unindexed.inc(applied.orphaned + applied.keyed)
        metrics?.blocks.set({ instance: instanceId }, this.index.blocks(instanceId))
      },
      onPurged: (reason) => {
        metrics?.purges.inc({ reason })
        metrics?.blocks.set({ instance: instanceId }, 0)
      },
    }).catch((err: unknown) => {
      log.warn({ err, instance: instanceId, endpoint: source.endpoint }, 'KV events: could not follow the instance')
      return undefined
    })
    this.#feeds.set(instanceId, opening)
    log.info({ instance: instanceId, endpoint: source.endpoint, replayEndpoint: source.replayEndpoint }, 'KV events: following the instance')
  }

  #purge(instanceId: string, reason: string): void {
    if (this.index.purge(instanceId)) this.#o.metrics?.purges.inc({ reason })
    this.#o.metrics?.blocks.set({ instance: instanceId }, 0)
  }

  #forget(instanceId: string, reason: string): void {
    const feed = this.#feeds.get(instanceId)
    if (!feed) return
    this.#feeds.delete(instanceId)
    void feed.then((f) => f?.close())
    this.#purge(instanceId, reason)
    this.#o.metrics?.blocks.remove({ instance: instanceId })
  }

  close(): void {
    this.#closed = true
    this.#unsubscribe()
    for (const id of [...this.#feeds.keys()]) this.#forget(id, 'removed')
  }
}
