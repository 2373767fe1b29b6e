import { setTimeout as sleep } from 'node:timers/promises'
import t from 'tap'
import { systemClock } from '../../common/clock.js'
import type { PeerGoneTarget } from '../../router/src/events/router-events.js'
import { RedisLeaseLedger } from '../../router/src/store/redis-lease-ledger.js'
import { Drainer } from '../../router/src/topology/drainer.js'
import { type Teardown, waitFor } from '../helpers/cluster.js'
import { needRedis } from '../helpers/redis.js'
import { sharedRouters } from '../helpers/shared-routers.js'

/*
 * Issue 20 (fr20): a drain judged a prefiller drained while D still had leases of it to read,
 * and D's connector, told peer_gone, failed those reads. A prefill leg issues its lease
 * before its slot goes back, so a drain that reads what is in flight *before* the unread
 * leases sees one or the other. These cases drive that order on real Redis, with the routers'
 * own parts in process (registry, shared topology, Redis lease ledger, drainer), so each step
 * happens exactly when the case says:
 * - on one router, a leg that ends while the drain reads the other routers' leases from Redis;
 * - a leg on another router, which has not yet heard of the drain.
 */

const config = [
  { id: 'p0', role: 'prefill' as const, url: 'http://127.0.0.1:1001' },
  { id: 'd0', role: 'decode' as const, url: 'http://127.0.0.1:1002' },
]

async function setup(t: Teardown) {
  const base = await sharedRouters(t, { prefix: 'sd:', instances: config, commandTimeoutMs: 1000 })
  /** A router with its Redis lease ledger and drainer, wired as redis-store.ts and core.ts do. */
  const router = async (routerId: string) => {
    const ledger = new RedisLeaseLedger({ redis: base.conn.client, prefix: base.prefix, routerId, routers: base.routers, clock: systemClock, leaseSeconds: 30, marginMs: 1000, retentionMs: 0, maxEntries: 1000 })
    t.teardown(() => ledger.close())
    // A case may hold this back, to see that the router's count waits for its leases.
    const held = { until: Promise.resolve() }
    const { registry, shared } = await base.router(routerId, {
      beforeInflight: async () => {
        await held.until
        return ledger.flush()
      },
    })
    registry.observeEngineId('p0', 'eng-p0')
    const gone: PeerGoneTarget[] = []
    const events = { peerGone: (target: PeerGoneTarget) => (gone.push(target), { seq: gone.length, engineIds: [...(target.engineIds ?? [])], unknown: [], aliveSkipped: [], logged: true }) }
    const drainer = new Drainer({ registry, ledger, events, clock: systemClock, logger: { info: () => {} }, pollMs: 50, remoteInflight: (id) => shared.remoteInflight(id) })
    t.teardown(() => drainer.close())
    let n = 0
    /** A prefill leg on p0 (its slot held) that ends when told: the lease, then the slot back, as handoff.ts does. */
    const leg = () => {
      registry.acquire('p0')
      const requestId = `${routerId}-${++n}`
      return {
        requestId,
        prefilled: () => {
          ledger.issue({ requestId, clientRequestId: requestId, prefill: 'p0', decode: 'd0', engineId: 'eng-p0', remoteRequestId: `x-${requestId}`, issuedAt: systemClock.now() })
          registry.release('p0')
        },
      }
    }
    return { registry, ledger, drainer, gone, leg, held }
  }
  return { router }
}

t.test('a drain on routers sharing Redis', { skip: needRedis(t) }, async (t) => {
  t.test('a prefill leg that ends while the drain reads Redis: its lease is counted, nothing is judged drained', async (t) => {
    const { router } = await setup(t)
    const a = await router('a')
    const leg = a.leg()
    // The drain's first look is under way (it reads the other routers' leases from Redis)
    // when P answers: the lease is issued and the slot goes back in between.
    const first = a.drainer.drain('p0')
    leg.prefilled()
    const s = await first
    t.match(s, { drained: false, removed: false }, 'not drained: the leg was in flight, then its lease is unread')
    t.same(a.gone, [], 'no peer_gone while D may still read')
    t.match(await a.drainer.status('p0'), { inflight: 0, unreadLeases: 1 })
    a.ledger.reading(leg.requestId)
    a.ledger.done(leg.requestId)
    t.match(await a.drainer.wait('p0', 5000), { drained: true, removed: true }, 'drained once D read it')
    t.same(a.gone, [{ engineIds: ['eng-p0'] }])
  })

  t.test("a leg on another router that has not heard of the drain yet: it waits for that router's count, then for its lease", async (t) => {
    const { router } = await setup(t)
    const a = await router('a')
    const b = await router('b')
    const leg = b.leg()
    const first = await a.drainer.drain('p0')
    t.match(first, { drained: false, removed: false }, "not drained before b said what it has in flight there")
    t.ok(await waitFor(() => b.registry.describe('p0')?.draining === true), 'b hears of the drain')
    t.ok(await waitFor(async () => (await a.drainer.status('p0')).inflight === 1), "a counts b's leg")
    // b's leases take their time to reach Redis: its count waits for them.
    let written = (): void => {}
    b.held.until = new Promise((resolve) => (written = resolve))
    leg.prefilled()
    await sleep(300)
    t.match(await a.drainer.status('p0'), { inflight: 1 }, "b's count still holds the leg while its lease is not yet in Redis")
    written()
    t.ok(await waitFor(async () => (await a.drainer.status('p0')).inflight === 0), 'the leg ended on b')
    t.match(await a.drainer.status('p0'), { drained: false, unreadLeases: 1 }, "b's lease was in Redis before its count fell")
    t.same(a.gone, [], 'no peer_gone while D may still read')
    b.ledger.reading(leg.requestId)
    b.ledger.done(leg.requestId)
    t.match(await a.drainer.wait('p0', 5000), { drained: true, removed: true }, 'drained once D read it')
    t.same(a.gone, [{ engineIds: ['eng-p0'] }])
  })
})
