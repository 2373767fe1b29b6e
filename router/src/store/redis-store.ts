import { randomUUID } from 'node:crypto'
import { RTR_ERR_CONFIG } from '../errors.js'
import type { LeaseRecord } from '../leases/ledger.js'
import { redactUrl, StoreConnection } from './connection.js'
import { LeaderLock } from './leader.js'
import { Membership } from './members.js'
import { RedisEventStore } from './redis-event-store.js'
import { RedisLeaseLedger } from './redis-lease-ledger.js'
import type { RouterStore, RouterStoreDeps } from './router-store.js'
import { SharedTopology } from './shared-topology.js'

/**
 * The shared store on one Redis (docs/several-routers.md): the event log, lease ledgers,
 * membership, the prober leader and the shared topology. Loaded by openRouterStore only when
 * `store.kind` is redis.
 */
export async function openRedisStore(deps: RouterStoreDeps): Promise<RouterStore> {
  const { config, clock, logger } = deps
  const { url, prefix, memberTtlMs, commandTimeoutMs } = config.store
  const routerId = randomUUID()
  let conn: StoreConnection
  try {
    conn = await StoreConnection.open({ url: url as string, commandTimeoutMs, clock, logger, ...(deps.metrics ? { metrics: deps.metrics } : {}) })
  } catch (err) {
    // A router that never saw the shared state has nothing to route from: refuse to start.
    throw new RTR_ERR_CONFIG(`store.url ${redactUrl(url as string)}: cannot reach Redis at start-up (${(err as Error).message})`, { cause: err })
  }
  const redis = conn.client
  const ledgers: RedisLeaseLedger[] = []
  let topology: SharedTopology | undefined
  const events = await RedisEventStore.open({
    redis,
    prefix,
    clock,
    retention: config.events.retention,
    deliveryEntries: config.events.deliveryEntries,
    ...(deps.onDelivered ? { onDelivered: deps.onDelivered } : {}),
    // Another log (Redis flushed, restarted empty or from an older snapshot): what this router
    // knows of the topology and its leases may be missing there too; both are written again.
    onReset: (id, why) => {
      logger.warn({ logId: id, why }, 'the event log is another one now (Redis lost or rolled back its data): agents start it over; this router logs again what it had not seen delivered, and shares its topology and leases again')
      deps.onEventLogReset?.()
      topology?.resync().catch(() => {})
      for (const l of ledgers) l.resync().catch(() => {})
    },
    // The connection's state says degraded meanwhile; this says why the reader stopped.
    onError: (err) => logger.warn({ err: String(err) }, 'the event log reader failed (a lost connection: it resumes after the last event it read once Redis answers)'),
  })
  const members = new Membership({ redis, routerId, prefix, ttlMs: memberTtlMs, clock, logger, ...(deps.url ? { url: deps.url } : {}) })
  await members.join()
  const leader = new LeaderLock({ redis, routerId, prefix, ttlMs: memberTtlMs, clock, logger })
  const goneListeners: ((routerId: string, unread: readonly LeaseRecord[]) => void)[] = []
  members.onDeparted((gone) => {
    void Promise.all(ledgers.map((l) => l.reap(gone))).then(
      (lists) => {
        const unread = lists.flat()
        logger.warn({ routerId: gone, unread: unread.length }, 'a router stopped renewing its membership: its unread leases are released')
        for (const l of goneListeners) l(gone, unread)
      },
      (err: unknown) => logger.warn({ routerId: gone, err: String(err) }, 'could not reap a departed router'),
    )
  })
  // The leader sweeps departed routers (a Lua script reports each one to one sweeper only).
  const sweep = setInterval(() => {
    if (leader.isLeader) members.sweep().catch(() => {})
  }, memberTtlMs)
  sweep.unref()
  await leader.start()
  const unState = conn.onChange((s) => {
    if (s.state !== 'ok') return
    for (const l of ledgers) l.resync().catch(() => {})
  })
  return {
    kind: 'redis',
    routerId,
    events,
    leadership: leader,
    get state() {
      return conn.state
    },
    onChange: (listener) => conn.onChange(listener),
    ledger: (opts) => {
      const l = new RedisLeaseLedger({ ...opts, clock, redis, prefix, routerId, routers: members })
      ledgers.push(l)
      return l
    },
    share: async ({ registry, agents }) => {
      topology = new SharedTopology({
        redis,
        prefix,
        routerId,
        registry,
        agents,
        clock,
        routers: members,
        leader,
        logger,
        beforeInflight: async () => (await Promise.all(ledgers.map((l) => l.flush()))).every(Boolean),
      })
      await topology.start()
      const t = topology
      return {
        anyOpen: (ids) => t.anyOpen(ids),
        opened: (id) => t.opened(id),
        closed: (id) => t.closed(id),
        remoteInflight: (id) => t.remoteInflight(id),
        publishVerdicts: () => t.publishVerdicts(),
      }
    },
    onRouterGone: (listener) => {
      goneListeners.push(listener)
    },
    close: async () => {
      clearInterval(sweep)
      unState()
      await topology?.close()
      for (const l of ledgers) await l.close?.()
      await leader.stop().catch(() => {})
      await members.leave().catch(() => {})
      await events.close()
      await conn.close()
    },
  }
}

