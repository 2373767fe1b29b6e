import { systemClock } from '../../common/clock.js'
import type { InstanceConfig } from '../../schemas/router-config.js'
import { AgentDirectory } from '../../router/src/events/agent-directory.js'
import { StoreConnection } from '../../router/src/store/connection.js'
import { LeaderLock } from '../../router/src/store/leader.js'
import { SharedTopology, type SharedTopologyOptions } from '../../router/src/store/shared-topology.js'
import { TopologyRegistry } from '../../router/src/topology/registry.js'
import type { Teardown } from './cluster.js'
import { type LocalRedis, startRedis } from './redis.js'

/*
 * Routers' shared parts in process, on one real redis-server (issue 10): each "router" is a
 * registry, an agent directory, a leader lock and a SharedTopology, as a router process has
 * them, so a test can drive each step. Membership is the `alive` set the test controls.
 */

const policy = { unhealthyThreshold: 1, baseEjectionMs: 1000, maxEjectionMs: 2000 }
const quiet = { info: () => {}, warn: () => {} }

export interface SharedRouter {
  registry: TopologyRegistry
  agents: AgentDirectory
  leader: LeaderLock
  shared: SharedTopology
}

export interface SharedRouters {
  server: LocalRedis
  conn: StoreConnection
  prefix: string
  /** The routers alive now (what Membership would answer). */
  alive: Set<string>
  routers: { alive(): Promise<readonly string[]> }
  /** Starts one; `beforeInflight` as SharedTopologyOptions. */
  router(routerId: string, opts?: Pick<SharedTopologyOptions, 'beforeInflight'>): Promise<SharedRouter>
}

export async function sharedRouters(t: Teardown, o: { prefix: string; instances: InstanceConfig[]; commandTimeoutMs?: number }): Promise<SharedRouters> {
  const server = await startRedis(t)
  const conn = await StoreConnection.open({ url: server.url, commandTimeoutMs: o.commandTimeoutMs ?? 300, maxBackoffMs: 100 })
  t.teardown(() => conn.close())
  const { prefix } = o
  const alive = new Set<string>()
  const routers = { alive: async () => [...alive] }
  const router = async (routerId: string, extra: Pick<SharedTopologyOptions, 'beforeInflight'> = {}): Promise<SharedRouter> => {
    const registry = new TopologyRegistry({ clock: systemClock, policy, instances: o.instances })
    const agents = new AgentDirectory({ clock: systemClock })
    const leader = new LeaderLock({ redis: conn.client, routerId, prefix, ttlMs: 600, clock: systemClock })
    await leader.start()
    t.teardown(() => leader.stop())
    alive.add(routerId)
    const shared = new SharedTopology({ redis: conn.client, prefix, routerId, registry, agents, clock: systemClock, routers, leader, logger: quiet, retryMs: 50, ...extra })
    await shared.start()
    t.teardown(() => shared.close())
    return { registry, agents, leader, shared }
  }
  return { server, conn, prefix, alive, routers, router }
}
