import { Counter, Gauge, Histogram, Registry } from 'prom-client'

/** The agent's Prometheus metrics (DESIGN "Observability"), on a private registry. */
export function createAgentMetrics() {
  const registry = new Registry()
  const registers = [registry]
  const fast = [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30]
  return {
    registry,
    pulls: new Counter({
      name: 'handoff_agent_pulls_total',
      help: 'Pulls by outcome (ok, kv_expired, peer_gone, disconnected, handshake_failed, read_failed, canceled, invalid)',
      labelNames: ['outcome'] as const,
      registers,
    }),
    kvExpired: new Counter({
      name: 'handoff_agent_kv_expired_total',
      help: "Pulls failed because P's lease was not surely alive: by reason and by check (before_read, after_read)",
      labelNames: ['reason', 'check'] as const,
      registers,
    }),
    pullsWithoutExpiry: new Counter({
      name: 'handoff_agent_pulls_without_expiry_total',
      help: 'Pulls accepted with no lease expiry (--allow-no-expiry), read with no lease check',
      registers,
    }),
    readBytes: new Counter({ name: 'handoff_agent_read_bytes_total', help: 'KV bytes READ from prefillers', registers }),
    readSeconds: new Histogram({ name: 'handoff_agent_read_seconds', help: 'NIXL READ time of a pull', buckets: fast, registers }),
    beforeReadSeconds: new Histogram({
      name: 'handoff_agent_pull_before_read_seconds',
      help: 'From accepting a pull to posting its READ (handshake and checks included)',
      buckets: fast,
      registers,
    }),
    pullSeconds: new Histogram({ name: 'handoff_agent_pull_seconds', help: 'Whole pull, accepted to answered', buckets: fast, registers }),
    taintedBlocks: new Gauge({
      name: 'handoff_agent_tainted_blocks',
      help: 'Destination blocks of failed READs not yet quiescent (kept from the engine)',
      registers,
    }),
    peers: new Gauge({ name: 'handoff_agent_peers', help: 'Peers by state (handshaking, ready, releasing)', labelNames: ['state'] as const, registers }),
    peerReleases: new Counter({
      name: 'handoff_agent_peer_releases_total',
      help: "Peers whose NIXL state was released, by reason (peer_gone, engine_id_changed, disconnect, stale_clock)",
      labelNames: ['reason'] as const,
      registers,
    }),
    handshakes: new Counter({ name: 'handoff_agent_handshakes_total', help: 'Handshakes sent, by outcome', labelNames: ['outcome'] as const, registers }),
    clockUncertainty: new Histogram({
      name: 'handoff_agent_handshake_clock_uncertainty_seconds',
      help: "A handshake's clock offset uncertainty (half the tightest sample's round trip); above a quarter lease no heartbeat is credited",
      buckets: [0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5],
      registers,
    }),
    heartbeats: new Counter({
      name: 'handoff_agent_heartbeats_total',
      help: 'HB: messages sent to prefillers, by outcome (ok, failed)',
      labelNames: ['outcome'] as const,
      registers,
    }),
    readDoneUnknown: new Counter({
      name: 'handoff_agent_read_done_unknown_total',
      help: 'Read-done notifications for requests no lease holds (prefiller): a decoder read blocks that may have been reused',
      registers,
    }),
    gaveUp: new Counter({
      name: 'handoff_agent_pull_gave_up_total',
      help: 'Failed pulls, once quiescent, reported to their prefiller as done with its blocks (read-done), by outcome (ok, failed)',
      labelNames: ['outcome'] as const,
      registers,
    }),
    heartbeatsReceived: new Counter({
      name: 'handoff_agent_heartbeats_received_total',
      help: 'Request ids in HB: messages received, by whether the lease was still held (extended, unknown)',
      labelNames: ['result'] as const,
      registers,
    }),
    leases: new Gauge({ name: 'handoff_agent_leases', help: 'KV leases held for the engine (prefiller)', registers }),
    leasesEnded: new Counter({
      name: 'handoff_agent_leases_ended_total',
      help: 'KV leases ended, by reason (read_done, released, expired)',
      labelNames: ['reason'] as const,
      registers,
    }),
    routerEvents: new Counter({
      name: 'handoff_agent_router_events_total',
      help: "Events applied from the router's log, by type (peer_gone, lease_release, snapshot)",
      labelNames: ['type'] as const,
      registers,
    }),
    routerConnected: new Gauge({ name: 'handoff_agent_router_connected', help: "1 while the router's event stream is open", registers }),
    engineEventsPending: new Gauge({ name: 'handoff_agent_engine_events_pending', help: 'Events the engine has not acknowledged', registers }),
  }
}

export type AgentMetrics = ReturnType<typeof createAgentMetrics>
