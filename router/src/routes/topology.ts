import type { FastifyPluginAsync } from 'fastify'
import type { PairingPolicy } from '../topology/selection.js'
import { paired } from '../topology/selection.js'
import type { TopologyRegistry } from '../topology/registry.js'
import type { RouterEvents } from '../events/router-events.js'
import type { PairBreakers } from '../topology/pair-breakers.js'

/**
 * `GET /topology` (admin-guarded: it names internal addresses): every instance with its
 * role, state, engine_ids, load and agents; which decoders may read from which prefillers
 * (and which pairs rest after KV-load failures);
 * and where the event log stands. A read of the registry's snapshot, nothing more.
 */
export const topologyRoutes: FastifyPluginAsync<{ registry: TopologyRegistry; events: RouterEvents; pairing: PairingPolicy; pairs: PairBreakers }> = async (app, opts) => {
  app.get('/topology', async () => {
    const snap = opts.registry.snapshot()
    const agents = opts.events.agents.all()
    const store = opts.events.store
    // The store may be unreachable (Redis away): the topology is still this router's to show.
    const acked = new Map(await Promise.all(agents.map(async (a) => [a.agentId, await store.acked(a.agentId).catch(() => null)] as const)))
    const instances = snap.instances.map((i) => ({
      id: i.id,
      role: i.role,
      source: i.source,
      url: i.url,
      // Every live engine_id behind its URL (data-parallel ranks, pods behind one Service);
      // engineId is the one added last, as before there were several.
      engineIds: i.engineIds,
      engineId: i.engineId ?? null,
      sharedRanks: i.sharedRanks,
      state: i.draining ? 'draining' : i.healthy ? 'ready' : 'unhealthy',
      inflight: i.inflight,
      labels: i.labels,
      models: i.models ? [...i.models] : null,
      agents: agents
        .filter((a) => a.instanceId === i.id)
        .map((a) => ({ agentId: a.agentId, kind: a.kind, engineId: a.engineId, peerAddress: a.peerAddress, streams: a.streams, acked: acked.get(a.agentId) ?? null })),
    }))
    const prefillers = snap.instances.filter((i) => i.role !== 'decode')
    const decoders = snap.instances.filter((i) => i.role !== 'prefill')
    const pairs: [string, string][] = []
    for (const p of prefillers) for (const d of decoders) if (p.id !== d.id && paired(p, d, opts.pairing)) pairs.push([p.id, d.id])
    return {
      instances,
      pairing: { ...opts.pairing, pairs, resting: opts.pairs.list() },
      unattachedAgents: agents.filter((a) => a.instanceId === undefined).map((a) => ({ agentId: a.agentId, engineId: a.engineId, peerAddress: a.peerAddress })),
      events: await Promise.all([store.first(), store.last()]).then(
        ([first, last]) => ({ first, last }),
        () => null,
      ),
    }
  })
}
