import { Counter, Gauge, type Registry, type RegistryContentType } from 'prom-client'

/**
 * The ledger's Prometheus metrics, on the router's registry. Shared by every ledger
 * implementation, so the in-memory one and the Redis one (issue 10) report alike.
 */
export function createLeaseMetrics(registry: Registry<RegistryContentType>, inFlight: () => { issued: number; reading: number }) {
  const registers = [registry]
  return {
    leases: new Gauge({
      name: 'handoff_router_leases',
      help: 'Unread KV leases in flight (P answered, D has not read yet), by state (issued, reading)',
      labelNames: ['state'] as const,
      registers,
      collect() {
        const n = inFlight()
        this.set({ state: 'issued' }, n.issued)
        this.set({ state: 'reading' }, n.reading)
      },
    }),
    issued: new Counter({
      name: 'handoff_router_leases_issued_total',
      help: 'KV leases recorded (prefill answers with kv_transfer_params)',
      registers,
    }),
    released: new Counter({
      name: 'handoff_router_leases_released_total',
      help: "Leases the router released before D read them (lease_release to P's agent), by reason",
      labelNames: ['reason'] as const,
      registers,
    }),
    abandoned: new Counter({
      name: 'handoff_router_leases_abandoned_total',
      help: "Leases being read whose exchange ended without D's first byte, by reason: never released early (D may still read), counted unread until P's lease surely ended",
      labelNames: ['reason'] as const,
      registers,
    }),
    lapsed: new Counter({
      name: 'handoff_router_leases_lapsed_total',
      help: "Leases whose time ran out: before_dispatch (caught before the decode leg; re-prefilled or failed), unread (expired while issued), after_dispatch (abandoned, then P's lease surely over)",
      labelNames: ['when'] as const,
      registers,
    }),
    evicted: new Counter({
      name: 'handoff_router_lease_ledger_evictions_total',
      help: 'Entries dropped because the ledger was at maxEntries (ended ones first, then the oldest unread)',
      labelNames: ['kind'] as const,
      registers,
    }),
  }
}

export type LeaseMetrics = ReturnType<typeof createLeaseMetrics>
