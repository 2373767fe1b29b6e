import type { FastifyBaseLogger } from 'fastify'
import { Agent, request, type Dispatcher } from 'undici'
import type { Clock } from '../../common/clock.js'
import type { Random } from '../../common/random.js'
import type { RouterConfig } from '../../schemas/router-config.js'
import { AdaptiveLimits } from './admission/adaptive-limits.js'
import { Admission } from './admission/admission.js'
import { AgentDirectory } from './events/agent-directory.js'
import { EngineNotifier } from './events/engine-notifier.js'
import { RouterEvents } from './events/router-events.js'
import type { LeaseEndReason, LeaseLedger, LeaseRecord } from './leases/ledger.js'
import { DecodePace } from './leases/decode-pace.js'
import { createRouterMetrics, type RouterMetrics } from './metrics.js'
import { CompletionProxy } from './proxy/proxy.js'
import { Upstream } from './proxy/upstream.js'
import { openRouterStore, type RouterStore, type SharedParts } from './store/router-store.js'
import { Drainer } from './topology/drainer.js'
import { PairBreakers } from './topology/pair-breakers.js'
import { Prober, type HttpGet } from './topology/prober.js'
import { TopologyRegistry } from './topology/registry.js'
import { KvIndexer } from './routing/kv-indexer.js'
import { PrefixRouting } from './routing/prefix-routing.js'
import { PromptTokens } from './routing/prompt-tokens.js'

/**
 * Everything a router is made of but its HTTP surface: the topology, the store (memory or
 * Redis), the event log and its agents, the lease ledger, drains, pair breakers, admission,
 * the proxy and the prober. app.ts puts the planes (planes.ts) in front of it; close() ends
 * it all, the store last.
 */
export interface RouterCore {
  config: RouterConfig
  registry: TopologyRegistry
  metrics: RouterMetrics
  store: RouterStore
  /** The parts several routers share (undefined with the memory store). */
  shared: SharedParts | undefined
  events: RouterEvents
  ledger: LeaseLedger
  drainer: Drainer
  pairs: PairBreakers
  admission: Admission
  /** Each instance's limit on requests in flight, following its engine (started with serving). */
  limits: AdaptiveLimits
  proxy: CompletionProxy
  prober: Prober
  /** The prefix index built from the engines' KV events (routing/kv-indexer.ts). */
  kv: KvIndexer
  /** The agent plane's streams, once it is up (ends them all when the log was replaced). */
  agentStreams: AgentStreams
  setAgentStreams(streams: AgentStreams): void
  close(): Promise<void>
}

export interface AgentStreams {
  endAll(): void
  unsent(): number
}

export interface CoreOptions {
  clock: Clock
  random: Random
  log: FastifyBaseLogger
  /** Another lease ledger (default: the store's, from `config.leases`). */
  ledger?: LeaseLedger
}

export async function openCore(config: RouterConfig, opts: CoreOptions): Promise<RouterCore> {
  const { clock, random, log } = opts
  // An agent that lost its stream reconnects within about three keep-alive intervals (they switch after three silent ones).
  const agents = new AgentDirectory({ clock, trustMs: 3 * config.events.keepAliveMs })
  const registry = new TopologyRegistry({
    clock,
    policy: config.health,
    instances: config.instances,
    pairing: config.pairing,
    limit: config.limits.maxInflightPerInstance,
    // An engine whose agent streams events is alive: another engine_id at its URL is a neighbour.
    engineLive: (engineId) => agents.streamOpenFor(engineId),
  })
  const metrics = createRouterMetrics()
  let agentStreams: AgentStreams = { endAll: (): void => {}, unsent: (): number => 0 }
  const store = await openRouterStore({
    config,
    clock,
    logger: log.child({ component: 'store' }),
    onDelivered: (event, ms) => metrics.eventDelivery.observe({ type: event.type }, ms / 1000),
    // Redis came back empty: a new log, so every agent starts over (ending its stream makes it register again).
    onEventLogReset: () => agentStreams.endAll(),
    metrics: { up: metrics.storeUp, lost: metrics.storeConnectionsLost },
  })
  const shared = await store.share({ registry, agents })
  const engineNotifier = new EngineNotifier({
    registry,
    agents,
    clock,
    logger: log.child({ component: 'engine-mode' }),
    urlTemplate: config.engineMode.peerGoneUrl,
    retries: config.engineMode.retries,
    timeoutMs: config.engineMode.timeoutMs,
    backoffMs: config.engineMode.backoffMs,
    ...(config.upstreamApiKey ? { apiKey: config.upstreamApiKey } : {}),
    metrics: metrics.engineNotifications,
  })
  const events = new RouterEvents({
    store: store.events,
    agents,
    registry,
    logger: log.child({ component: 'events' }),
    metrics: { events: metrics.events, decisionsDropped: metrics.decisionsDropped },
    maxAgents: config.limits.maxAgents,
    onLogged: (event) => engineNotifier.notify(event),
    ...(shared ? { presence: shared } : {}),
  })
  const ledger =
    opts.ledger ??
    store.ledger({
      ...config.leases,
      registry: metrics.registry,
      onRelease: (leases, reason) => releaseToPrefillers(events, leases, reason),
    })
  // A router replica that died took its clients with it: leases nobody will read now.
  store.onRouterGone((_routerId, unread) => releaseToPrefillers(events, unread, 'router_gone'))
  const drainer = new Drainer({ registry, ledger, events, clock, logger: log.child({ component: 'drain' }), ...(shared ? { remoteInflight: shared.remoteInflight } : {}) })
  const dispatcher = upstreamAgent(config)
  const probes = probeAgent(config)
  const pairLog = log.child({ component: 'pairs' })
  // Decoders' pace, for a checked read proven by D's whole answer (handoff.ts); it re-prefills when that fails.
  const pace = config.leases.proveByWholeAnswer && config.leases.onLapsed === 'reprefill' ? new DecodePace() : undefined
  const pairs = new PairBreakers({
    clock,
    policy: config.pairBreaker,
    onOpen: (prefill, decode) => {
      metrics.pairBreakerOpens.inc()
      pairLog.warn({ prefill, decode }, 'pair breaker open: KV loads from this prefiller to this decoder keep failing')
    },
  })
  registry.subscribe((change) => {
    if (change.type !== 'removed') return
    pairs.forget(change.instanceId)
    pace?.forget(change.instanceId)
  })
  const admission = new Admission({
    pairs,
    registry,
    clock,
    random,
    ...config.admission,
    metrics: { queueDepth: metrics.queueDepth, queueWait: metrics.queueWait },
  })
  const limits = new AdaptiveLimits({
    registry,
    get: httpGet(probes, config.upstreamApiKey),
    clock,
    log: log.child({ component: 'limits' }),
    policy: config.admission.limit,
    timeoutMs: config.health.timeoutMs,
    queued: () => admission.queued,
    metrics: { limit: metrics.instanceLimit, changes: metrics.limitChanges, samples: metrics.engineLoadSamples },
  })
  // Which prompt prefixes each engine holds, from the KV events of those that publish them.
  const kv = new KvIndexer({
    registry,
    config: config.kvIndex,
    log: log.child({ component: 'kv-index' }),
    seed: Math.floor(random.next() * 0x7fffffff),
    metrics: {
      blocks: metrics.kvIndexBlocks,
      batches: metrics.kvEventBatches,
      purges: metrics.kvIndexPurges,
      evicted: metrics.kvIndexEvicted,
      unindexed: metrics.kvIndexUnindexed,
    },
  })
  // Prefix-aware selection on that index: a prompt's token ids from the engine's /tokenize.
  const prefix = new PrefixRouting({
    config: config.routing,
    index: kv.index,
    registry,
    random,
    tokens: new PromptTokens({
      dispatcher,
      ...config.routing.tokenize,
      apiKey: config.upstreamApiKey,
      onOutcome: (outcome, ms) => {
        metrics.tokenize.inc({ outcome })
        if (outcome !== 'ids') metrics.tokenizeDuration.observe(ms / 1000)
      },
    }),
    metrics: { choices: metrics.routingChoices, cachedTokens: metrics.routingCachedTokens, decodeOnly: metrics.decodeOnly },
  })
  const proxy = new CompletionProxy({
    registry,
    admission,
    upstream: new Upstream({ dispatcher, registry, metrics, onFirstToken: (id, ms) => limits.observeFirstToken(id, ms) }),
    ledger,
    metrics,
    clock,
    random,
    timeouts: config.timeouts,
    onLapsed: config.leases.onLapsed,
    ...(config.leases.readCheck !== 'engine' ? { readWithinMs: readDeadline(config, agents) } : {}),
    ...(pace ? { pace } : {}),
    maxHandoffsPerRequest: config.limits.maxHandoffsPerRequest,
    engineAnswered: (engineId) => events.engineAnswered(engineId),
    pairs,
    prefix,
    ...(config.upstreamApiKey ? { upstreamApiKey: config.upstreamApiKey } : {}),
  })
  const prober = new Prober({
    registry,
    get: httpGet(probes, config.upstreamApiKey),
    clock,
    log: log.child({ component: 'prober' }),
    intervalMs: config.health.intervalMs,
    timeoutMs: config.health.timeoutMs,
  })
  const topologyLog = log.child({ component: 'topology' })
  registry.subscribe((change) => {
    // Per request, and per engine sample while busy: too frequent to log (the limits log theirs at debug).
    if (change.type === 'released' || change.type === 'limit') return
    if (change.type === 'busy') {
      // Under overload, one per failed connect: counted, logged at debug.
      metrics.healthFailuresExcused.inc({ check: change.check })
      topologyLog.debug({ ...change }, `instance ${change.instanceId}: ${change.check} failed while it answered others, not counted`)
      return
    }
    const role = 'role' in change ? change.role : (registry.snapshot().instances.find((i) => i.id === change.instanceId)?.role ?? 'unknown')
    if (change.type === 'removed') metrics.instanceUp.remove({ instance: change.instanceId, role })
    if (change.type === 'up' || change.type === 'down') metrics.instanceUp.set({ instance: change.instanceId, role }, change.type === 'up' ? 1 : 0)
    if (change.type === 'ejected' || change.type === 'engine_id_changed') metrics.topologyChanges.inc({ type: change.type })
    topologyLog.info({ ...change }, `instance ${change.instanceId}: ${change.type}`)
  })

  return {
    config,
    registry,
    metrics,
    store,
    shared,
    events,
    ledger,
    drainer,
    pairs,
    admission,
    limits,
    proxy,
    prober,
    kv,
    get agentStreams() {
      return agentStreams
    },
    setAgentStreams: (streams) => {
      agentStreams = streams
    },
    close: async () => {
      prober.stop()
      kv.close()
      limits.close()
      events.close()
      drainer.close()
      admission.close()
      await Promise.all([dispatcher.close(), probes.close(), engineNotifier.close()])
      await store.close()
    },
  }
}

/**
 * leases.readCheck: how soon after P's answer a decoder's first token must come when the
 * router checks its reads; undefined for one that checks them itself (`auto`: one with a
 * registered transfer agent; handoff's vLLM connector follows events but checks no read).
 * Registrations count only when agents must prove the agent token: on an open agent plane
 * anyone could register an "agent" for a stock decoder and so switch the router's check off.
 */
function readDeadline(config: RouterConfig, agents: AgentDirectory): (decode: string) => number | undefined {
  const { leases } = config
  const within = leases.leaseSeconds * 1000 - leases.marginMs
  if (leases.readCheck === 'router' || config.agentToken === undefined) return () => within
  return (decode) => (agents.checksReads(decode) ? undefined : within)
}

function upstreamAgent(config: RouterConfig): Agent {
  return new Agent({
    connections: config.limits.connectionsPerUpstream,
    // Below the engine's own keep-alive (uvicorn: 5 s), and never raised by a server's hint.
    keepAliveTimeout: config.timeouts.upstreamKeepAliveMs,
    keepAliveMaxTimeout: config.timeouts.upstreamKeepAliveMs,
    connect: { timeout: config.timeouts.connectMs },
    headersTimeout: config.timeouts.decodeHeadersMs,
    bodyTimeout: config.timeouts.idleMs,
  })
}

/** Probes get connections of their own: queued behind traffic they would time out under load. */
function probeAgent(config: RouterConfig): Agent {
  return new Agent({
    connections: 2,
    keepAliveTimeout: config.timeouts.upstreamKeepAliveMs,
    keepAliveMaxTimeout: config.timeouts.upstreamKeepAliveMs,
    connect: { timeout: Math.min(config.timeouts.connectMs, config.health.timeoutMs) },
  })
}

function httpGet(dispatcher: Dispatcher, apiKey: string | undefined): HttpGet {
  // Engines started with --api-key guard /v1 (so /v1/models); the key goes on every probe.
  const headers = apiKey ? { authorization: `Bearer ${apiKey}` } : {}
  return async (url, timeoutMs) => {
    const res = await request(url, { dispatcher, headers, headersTimeout: timeoutMs, bodyTimeout: timeoutMs, signal: AbortSignal.timeout(timeoutMs) })
    return { status: res.statusCode, text: await res.body.text() }
  }
}

/**
 * Leases nobody will read: one lease_release per prefiller engine for its agent. Without
 * remote_request_id (vLLM before late 2025) P's agent could not name the blocks; those wait
 * for P's own expiry.
 */
function releaseToPrefillers(events: RouterEvents, leases: readonly LeaseRecord[], reason: LeaseEndReason): void {
  const byEngine = new Map<string, string[]>()
  for (const l of leases) {
    if (l.remoteRequestId === undefined) continue
    const ids = byEngine.get(l.engineId) ?? []
    ids.push(l.remoteRequestId)
    byEngine.set(l.engineId, ids)
  }
  for (const [prefillEngineId, requestIds] of byEngine) events.releaseLater({ prefillEngineId, requestIds, reason })
}

