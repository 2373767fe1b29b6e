import { Counter, Gauge, Histogram, Registry, type OpenMetricsContentType } from 'prom-client'

/**
 * The router's Prometheus metrics, on a private registry (never prom-client's global one).
 * The registry serves OpenMetrics text: the request-duration histogram carries the client's
 * X-Request-Id of the latest request per bucket as an exemplar, to jump from a slow bucket to
 * that request's logs.
 */
export function createRouterMetrics() {
  const registry = new Registry<OpenMetricsContentType>()
  registry.setContentType(Registry.OPENMETRICS_CONTENT_TYPE)
  const registers = [registry]
  return {
    registry,
    requests: new Counter({
      name: 'handoff_router_requests_total',
      help: 'Completion requests by route mode (pd, single, none) and outcome (ok, client_gone, http_<engine 4xx> or a router error code)',
      labelNames: ['mode', 'outcome'] as const,
      registers,
    }),
    requestDuration: new Histogram({
      name: 'handoff_router_request_duration_seconds',
      help: 'Time from request start to the last byte sent',
      labelNames: ['mode'] as const,
      buckets: [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60],
      registers,
      enableExemplars: true,
    }),
    prefillDuration: new Histogram({
      name: 'handoff_router_prefill_duration_seconds',
      help: 'Prefill leg: request sent to P until its whole answer arrived',
      buckets: [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30],
      registers,
    }),
    events: new Counter({
      name: 'handoff_router_events_total',
      help: 'Events logged for the agents, by type (peer_gone, lease_release)',
      labelNames: ['type'] as const,
      registers,
    }),
    decisionsDropped: new Counter({
      name: 'handoff_router_decisions_dropped_total',
      help: "The router's own decisions (peer_gone, lease_release, ...) the event store refused for good, not for an outage: dropped so that later ones go on",
      registers,
    }),
    pairBreakerOpens: new Counter({
      name: 'handoff_router_pair_breaker_opens_total',
      help: 'Times a (prefiller, decoder) pair breaker opened after KV-load failures',
      registers,
    }),
    eventDelivery: new Histogram({
      name: 'handoff_router_event_delivery_seconds',
      help: 'From logging an event to the last expected agent acknowledging it, by type',
      labelNames: ['type'] as const,
      buckets: [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30],
      registers,
    }),
    storeUp: new Gauge({
      name: 'handoff_router_store_up',
      help: '1 while the shared store (Redis) answers, 0 while this router routes from its last topology without it; always 1 with the memory store',
      registers,
    }),
    storeConnectionsLost: new Counter({
      name: 'handoff_router_store_connections_lost_total',
      help: "Connections to the shared store (Redis) that were ready and closed: the command connection, or a live reader's (the event log, the shared topology), which is also dropped when it carries nothing for its block time plus store.commandTimeoutMs",
      labelNames: ['connection'] as const,
      registers,
    }),
    proberLeader: new Gauge({
      name: 'handoff_router_prober_leader',
      help: '1 while this router probes the engines for every router sharing its store (the prober leader), else 0',
      registers,
    }),
    agents: new Gauge({
      name: 'handoff_router_agents',
      help: 'Registered transfer agents, by whether an event stream is open (connected, disconnected)',
      labelNames: ['state'] as const,
      registers,
    }),
    agentStreamsCut: new Counter({
      name: 'handoff_router_agent_streams_cut_total',
      help: 'Agent event streams the router cut, by reason (stalled: took nothing for a keep-alive interval with its buffer full; replaced: the agent opened another)',
      labelNames: ['reason'] as const,
      registers,
    }),
    agentStreamUnsent: new Gauge({
      name: 'handoff_router_agent_stream_unsent_bytes',
      help: 'Bytes written to agent event streams that their sockets have not sent yet, all streams together (each is held to events.streamBufferBytes plus one event)',
      registers,
    }),
    kvIndexBlocks: new Gauge({
      name: 'handoff_router_kv_index_blocks',
      help: "KV blocks the router's prefix index holds for an instance, from its KV events (each instance is held to kvIndex.maxBlocksPerEngine)",
      labelNames: ['instance'] as const,
      registers,
    }),
    kvEventBatches: new Counter({
      name: 'handoff_router_kv_event_batches_total',
      help: 'KV event batches applied to the prefix index, by instance',
      labelNames: ['instance'] as const,
      registers,
    }),
    kvIndexPurges: new Counter({
      name: 'handoff_router_kv_index_purges_total',
      help: "An instance's prefix index dropped whole, by reason (gap: lost events replay could not fill; unreadable; restart: its publisher started over; engine_id: a new engine_id answered; removed)",
      labelNames: ['reason'] as const,
      registers,
    }),
    kvIndexEvicted: new Counter({
      name: 'handoff_router_kv_index_evicted_blocks_total',
      help: "Blocks the router's prefix index dropped to keep an instance within kvIndex.maxBlocksPerEngine (the oldest stored first)",
      registers,
    }),
    kvIndexUnindexed: new Counter({
      name: 'handoff_router_kv_index_unindexed_blocks_total',
      help: "Blocks engines announced that the prefix index left out: their parent block was not indexed (an event lost, or evicted here), or their hash covers more than their tokens (LoRA, cache_salt, multimodal)",
      registers,
    }),
    routingChoices: new Counter({
      name: 'handoff_router_routing_choices_total',
      help: "Prefix-aware choices of a leg's instance (docs/routing.md), by leg (prefill, decode, single) and reason (prefix: chosen for its cached share; load: the load pick won over holders; cold: no candidate held any of the prompt)",
      labelNames: ['leg', 'reason'] as const,
      registers,
    }),
    routingCachedTokens: new Counter({
      name: 'handoff_router_routing_cached_tokens_total',
      help: "Prompt tokens the chosen instance held in its KV cache by the router's prefix index, by leg: what the choice expects the engine not to compute (prefill, single) or not to pull (decode)",
      labelNames: ['leg'] as const,
      registers,
    }),
    decodeOnly: new Counter({
      name: 'handoff_router_decode_only_total',
      help: 'Requests sent to a decoder alone, with no prefill leg (docs/routing.md), by reason (held: the decoder holds all but routing.decodeOnly.maxUncachedTokens of the prompt; short: the prompt is at most routing.decodeOnly.maxPromptTokens)',
      labelNames: ['reason'] as const,
      registers,
    }),
    tokenize: new Counter({
      name: 'handoff_router_tokenize_total',
      help: "Prompts' token ids for prefix-aware routing, by outcome (tokenized: the engine's /tokenize answered; cached: known from an earlier request; ids: the prompt was token ids; failed: routed on load alone)",
      labelNames: ['outcome'] as const,
      registers,
    }),
    tokenizeDuration: new Histogram({
      name: 'handoff_router_tokenize_duration_seconds',
      help: "Time to a prompt's token ids for prefix-aware routing (an engine's /tokenize, or the router's cache)",
      buckets: [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5],
      registers,
    }),
    engineNotifications: new Counter({
      name: 'handoff_router_engine_notifications_total',
      help: 'peer_gone calls to engines without an agent (engine mode), by outcome (ok, failed, not_configured)',
      labelNames: ['outcome'] as const,
      registers,
    }),
    handoffGap: new Histogram({
      name: 'handoff_router_handoff_gap_seconds',
      help: "From P's answer to D's first response byte",
      buckets: [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30],
      registers,
    }),
    upstreamErrors: new Counter({
      name: 'handoff_router_upstream_errors_total',
      help: 'Upstream failures by leg and error code',
      labelNames: ['leg', 'code'] as const,
      registers,
    }),
    lateReads: new Counter({
      name: 'handoff_router_late_reads_total',
      help: "Decode answers whose first token came after the lease's expiry minus the margin (leases.readCheck router): withheld, since D's read may have found reused blocks",
      registers,
    }),
    wholeAnswerReads: new Counter({
      name: 'handoff_router_whole_answer_reads_total',
      help: "Checked reads of non-streamed requests proven by D's whole answer arriving within the read window (leases.proveByWholeAnswer), with no streamed decode leg",
      registers,
    }),
    unprovenReads: new Counter({
      name: 'handoff_router_unproven_reads_total',
      help: "Non-streamed decode legs whose whole answer did not come within the read window (leases.proveByWholeAnswer): the answer was dropped and the prompt prefilled again with a streamed leg",
      registers,
    }),
    handoffsWithoutParams: new Counter({
      name: 'handoff_router_prefill_without_params_total',
      help: 'Prefill answers without usable kv_transfer_params (D then prefilled locally)',
      registers,
    }),
    inflight: new Gauge({
      name: 'handoff_router_inflight_requests',
      help: 'Completion requests in progress',
      registers,
    }),
    queueDepth: new Gauge({
      name: 'handoff_router_admission_queue_depth',
      help: 'Requests waiting for a free slot on an instance',
      registers,
    }),
    queueWait: new Histogram({
      name: 'handoff_router_admission_wait_seconds',
      help: 'Time a request waited in the admission queue before it was admitted',
      buckets: [0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30],
      registers,
    }),
    topologyChanges: new Counter({
      name: 'handoff_router_topology_changes_total',
      help: 'Instance ejections and engine_id changes seen by the registry',
      labelNames: ['type'] as const,
      registers,
    }),
    healthFailuresExcused: new Counter({
      name: 'handoff_router_health_failures_excused_total',
      help: 'Probes without an answer (check="probe") and requests that could not connect (check="connect") not counted against an instance, because it answered other requests meanwhile: busy, not gone',
      labelNames: ['check'] as const,
      registers,
    }),
    instanceLimit: new Gauge({
      name: 'handoff_router_instance_limit',
      help: 'Requests this router lets an instance have in flight now (admission.limit)',
      labelNames: ['instance'] as const,
      registers,
    }),
    limitChanges: new Counter({
      name: 'handoff_router_instance_limit_changes_total',
      help: 'Adaptive limit moves, up or down, after an engine load sample',
      labelNames: ['direction'] as const,
      registers,
    }),
    engineLoadSamples: new Counter({
      name: 'handoff_router_engine_load_samples_total',
      help: 'Reads of an engine /metrics for its running and waiting requests: ok, no_metrics (answered without them), failed',
      labelNames: ['outcome'] as const,
      registers,
    }),
    instanceUp: new Gauge({
      name: 'handoff_router_instance_up',
      help: 'Whether the last health probe of an instance passed (1) or failed (0)',
      labelNames: ['instance', 'role'] as const,
      registers,
    }),
  }
}

export type RouterMetrics = ReturnType<typeof createRouterMetrics>
