import { setTimeout as sleep } from 'node:timers/promises'
import { Redis } from 'ioredis'
import { Registry } from 'prom-client'
import t, { type Test } from 'tap'
import { ManualClock } from '../../common/clock.js'
import type { HandoffLease, LeaseRecord } from '../../router/src/leases/ledger.js'
import { RedisLeaseLedger, type RedisLeaseLedgerOptions } from '../../router/src/store/redis-lease-ledger.js'
import { type LocalRedis, needRedis, startRedis } from '../helpers/redis.js'
import { leaseLedgerContract } from './lease-ledger.contract.js'

// The Redis lease ledger against the ledger contract (one router alive: it must count as the
// in-memory one), then what only Redis has: other routers' leases, membership, reaping a dead
// router's hash, and an outage, on a real redis-server. Each case has its own key prefix.

/** Bounded: true once `check` holds, false after `ms` (real time: Redis I/O). */
async function until(check: () => boolean | Promise<boolean>, ms = 5000): Promise<boolean> {
  const deadline = Date.now() + ms
  while (!(await check())) {
    if (Date.now() > deadline) return false
    await sleep(10)
  }
  return true
}

t.test('the Redis lease ledger', { skip: needRedis(t) }, async (t) => {
  const server = await startRedis(t)
  let cases = 0

  // Fails fast while the server is gone (the router sets commandTimeout from store.commandTimeoutMs).
  const connect = (port: number): Redis => {
    const redis = new Redis(port, '127.0.0.1', { commandTimeout: 300, retryStrategy: () => 50 })
    redis.on('error', () => {}) // refused reconnects during the outage case: expected
    return redis
  }
  const client = (t: Test): Redis => {
    const redis = connect(server.port)
    t.teardown(() => redis.disconnect())
    return redis
  }
  /** A ledger on its own connection; at the end it is closed (its last writes sent), then the connection. */
  const ledgerOn = (t: Test, opts: Omit<RedisLeaseLedgerOptions, 'redis'>, port = server.port): RedisLeaseLedger => {
    const redis = connect(port)
    let ledger: RedisLeaseLedger
    try {
      ledger = new RedisLeaseLedger({ ...opts, redis })
    } catch (err) {
      redis.disconnect()
      throw err
    }
    t.teardown(async () => {
      await ledger.close()
      redis.disconnect()
    })
    return ledger
  }

  /** Ledgers of several routers on one prefix, with a membership the case sets by hand. */
  const cluster = (t: Test, clock = new ManualClock()) => {
    const prefix = `case${++cases}:`
    const alive = new Set<string>()
    const routers = { alive: async () => [...alive] }
    const open = (routerId: string, over: Partial<RedisLeaseLedgerOptions> = {}): RedisLeaseLedger => {
      const ledger = ledgerOn(t, { prefix, routerId, routers, clock, leaseSeconds: 30, marginMs: 1000, retentionMs: 60_000, maxEntries: 1000, ...over })
      alive.add(routerId)
      return ledger
    }
    let n = 0
    const lease = (o: Partial<HandoffLease> = {}): HandoffLease => {
      n++
      return { requestId: `r${n}`, clientRequestId: `c${n}`, prefill: 'p0', decode: 'd0', engineId: 'eng-p0', issuedAt: clock.now(), ...o }
    }
    const hash = async (redis: Redis, routerId: string): Promise<Record<string, LeaseRecord>> => {
      const raw = await redis.hgetall(`${prefix}leases:${routerId}`)
      return Object.fromEntries(Object.entries(raw).map(([k, v]) => [k, JSON.parse(v) as LeaseRecord]))
    }
    return { clock, prefix, alive, routers, open, lease, hash }
  }

  leaseLedgerContract(t, {
    open: async (t, opts) => ledgerOn(t, { ...opts, prefix: `contract${++cases}:`, routerId: 'solo', routers: { alive: async () => ['solo'] } }),
  })

  t.test('two routers on one Redis count each other’s unread leases', async (t) => {
    const { clock, open, lease, hash } = cluster(t)
    const a = open('a')
    const b = open('b')
    const [a1, a2] = [lease(), lease({ decode: 'd1' })]
    a.issue(a1)
    a.issue(a2)
    a.reading(a2.requestId)
    clock.advance(100)
    const [b1, b2] = [lease(), lease({ prefill: 'p1' })]
    b.issue(b1)
    b.issue(b2)
    b.redirect(b2.requestId, 'd1')
    t.ok((await a.flush()) && (await b.flush()), 'mirrored')
    const redis = client(t)
    t.match(await hash(redis, 'a'), { [a1.requestId]: { state: 'issued', prefill: 'p0' }, [a2.requestId]: { state: 'reading', decode: 'd1' } })
    t.match(await hash(redis, 'b'), { [b2.requestId]: { decode: 'd1', expiresAt: b2.issuedAt + 30_000 } })

    for (const ledger of [a, b]) t.equal(await ledger.unreadBy('p0'), 3, 'either router counts all three on p0')
    const s = await a.summary()
    t.same(s.inFlight, { issued: 3, reading: 1 })
    t.same(s.byPrefill, { p0: 3, p1: 1 })
    t.same(s.byDecode, { d0: 2, d1: 2 })
    t.equal(s.oldestAgeMs, 100)
    t.equal(s.entries, 2, "entries are this router's own")
    const d1 = await b.summary({ instance: 'd1' })
    t.same(
      d1.leases?.map((l) => l.requestId),
      [a2.requestId, b2.requestId],
      "the instance filter lists the other router's leases too, oldest first",
    )

    b.done(b1.requestId)
    b.release(b2.requestId, 'client_gone')
    await b.flush()
    t.same(await hash(redis, 'b'), {}, 'ended leases leave the hash')
    t.equal(await a.unreadBy('p0'), 2)
    t.same((await a.summary()).released, {}, "lifetime totals are this router's own")
    t.same((await b.summary()).released, { client_gone: 1 })

    // b4 stays in b's hash past its expiry (b is idle, nothing sweeps it): P freed it, nobody counts it.
    b.issue(lease())
    await b.flush()
    clock.advance(30_000)
    t.equal(Object.keys(await hash(redis, 'b')).length, 1)
    t.equal(await a.unreadBy('p0'), 1, "only a's lease being read is left")
  })

  t.test('a router that is no longer alive stops counting', async (t) => {
    const { alive, open, lease } = cluster(t)
    const a = open('a')
    const b = open('b')
    b.issue(lease())
    await b.flush()
    t.equal(await a.unreadBy('p0'), 1)
    alive.delete('b')
    t.equal(await a.unreadBy('p0'), 0)
    t.same((await a.summary()).inFlight, { issued: 0, reading: 0 })
    t.equal(await b.unreadBy('p0'), 1, 'its own memory is still its own')
  })

  t.test('reap: a dead router’s issued, unexpired leases, once; its hash is gone', async (t) => {
    const { clock, alive, open, lease, hash } = cluster(t)
    const dead = open('dead')
    const survivor = open('survivor')
    const expired = lease()
    dead.issue(expired)
    clock.advance(20_000)
    const [issued, reading, other] = [lease(), lease(), lease({ prefill: 'p1' })]
    for (const l of [issued, reading, other]) dead.issue(l)
    dead.reading(reading.requestId)
    await dead.flush()
    clock.advance(15_000)
    alive.delete('dead')
    const redis = client(t)
    t.equal(Object.keys(await hash(redis, 'dead')).length, 4, 'the expired one is still in the hash (nothing swept it)')

    const reaped = await survivor.reap('dead')
    t.same(reaped.map((l) => l.requestId).sort(), [issued.requestId, other.requestId].sort(), 'issued and unexpired only: not the one being read, not the expired one')
    t.match(reaped.find((l) => l.requestId === issued.requestId), { state: 'issued', engineId: 'eng-p0', clientRequestId: issued.clientRequestId, expiresAt: issued.issuedAt + 30_000 })
    t.same(await hash(redis, 'dead'), {}, 'deleted')
    t.same(await survivor.reap('dead'), [], 'a second reap finds nothing')
    t.same(await survivor.reap('never-was'), [])
    await t.rejects(survivor.reap('survivor'), RangeError, 'never its own')
  })

  t.test('close writes what is pending and deletes nothing', async (t) => {
    const { open, lease, hash } = cluster(t)
    const a = open('a')
    const l = lease()
    a.issue(l)
    await a.close()
    await a.close()
    a.issue(lease())
    t.same(Object.keys(await hash(client(t), 'a')), [l.requestId], 'after close only memory changes')
    t.equal(await a.unreadBy('p0'), 2)
  })

  t.test('bad options are refused', async (t) => {
    const { open } = cluster(t)
    t.throws(() => open(''), RangeError)
    t.throws(() => open('x', { keyTtlMs: 0 }), RangeError)
    t.throws(() => open('x', { leaseSeconds: 0 }), RangeError)
  })

  t.test('each write renews the hash’s expiry', async (t) => {
    const { open, lease, prefix } = cluster(t)
    const a = open('a', { keyTtlMs: 60_000 })
    a.issue(lease())
    await a.flush()
    const ttl = await client(t).pttl(`${prefix}leases:a`)
    t.ok(ttl > 0 && ttl <= 60_000, `with an expiry (${ttl} ms)`)
  })

  t.test('failing membership: unreadBy rejects, summary says partial', async (t) => {
    const clock = new ManualClock()
    const errors: unknown[] = []
    const ledger = ledgerOn(t, {
      prefix: `case${++cases}:`,
      routerId: 'a',
      routers: { alive: async () => Promise.reject(new Error('membership unreachable')) },
      clock,
      leaseSeconds: 30,
      marginMs: 1000,
      retentionMs: 1000,
      maxEntries: 10,
      onError: (err) => errors.push(err),
    })
    ledger.issue({ requestId: 'r', clientRequestId: 'c', prefill: 'p0', decode: 'd0', engineId: 'e', issuedAt: clock.now() })
    await t.rejects(ledger.unreadBy('p0'), { code: 'RTR_ERR_STORE_UNAVAILABLE', cause: { message: 'membership unreachable' } })
    t.match(await ledger.summary(), { partial: true, inFlight: { issued: 1, reading: 0 } })
    t.equal(errors.length, 1, 'the fallback is reported')
  })

  // Its own server: stopping it must not take the other cases' Redis away.
  t.test('a Redis outage: the request path goes on; the hash is rewritten when Redis is back', async (t) => {
    const own: LocalRedis = await startRedis(t)
    const clock = new ManualClock()
    const registry = new Registry()
    const errors: unknown[] = []
    const alive = new Set(['a', 'b'])
    const routers = { alive: async () => [...alive] }
    const opts = { routers, clock, leaseSeconds: 30, marginMs: 1000, retentionMs: 60_000, maxEntries: 100 }
    const a = ledgerOn(t, { ...opts, routerId: 'a', registry, onError: (err) => errors.push(err) }, own.port)
    const b = ledgerOn(t, { ...opts, routerId: 'b' }, own.port)
    const redis = connect(own.port)
    t.teardown(() => redis.disconnect())
    let n = 0
    const lease = (): HandoffLease => ({ requestId: `r${++n}`, clientRequestId: 'c', prefill: 'p0', decode: 'd0', engineId: 'e', issuedAt: clock.now() })
    const r1 = lease()
    a.issue(r1)
    t.ok(await a.flush())

    await own.stop()
    // Every call on the request path answers from memory, synchronously, without throwing.
    const [r2, r3, r4] = [lease(), lease(), lease()]
    a.issue(r2)
    a.issue(r3)
    a.issue(r4)
    a.reading(r1.requestId)
    a.redirect(r2.requestId, 'd1')
    a.release(r3.requestId, 'client_gone')
    t.notOk(a.lapsed(r4.requestId))
    t.equal(a.release(r1.requestId, 'decode_failed'), 'abandoned', 'a lease being read is abandoned, not released')
    t.equal(await a.flush(), false, 'the write failed')
    t.ok(a.dirty, 'the mirror is marked dirty')
    t.ok(errors.length >= 1, 'failures are reported')
    t.match(await registry.metrics(), /handoff_router_lease_store_failures_total\{op="write"\} [1-9]/)
    await t.rejects(a.unreadBy('p0'), { code: 'RTR_ERR_STORE_UNAVAILABLE' }, 'no partial count for a drain')
    const s = await a.summary()
    t.match(s, { partial: true, inFlight: { issued: 2, reading: 1 }, byPrefill: { p0: 3 }, released: { client_gone: 1 } }, "this router's own, marked partial")
    t.match(await registry.metrics(), /handoff_router_lease_store_failures_total\{op="read"\} [1-9]/)
    await t.rejects(a.reap('gone'), 'a reap fails with Redis')
    t.match(await registry.metrics(), /handoff_router_lease_store_failures_total\{op="reap"\} 1/)

    // Back, and empty: the next change rewrites the whole hash, not just itself.
    await own.start()
    t.ok(await until(() => redis.status === 'ready'), 'reconnected')
    const r5 = lease()
    a.issue(r5)
    t.ok(await a.flush())
    t.notOk(a.dirty)
    t.same(Object.keys(await redis.hgetall('handoff:leases:a')).sort(), [r1, r2, r4, r5].map((l) => l.requestId).sort(), 'all unread ones are back')
    t.equal(await b.unreadBy('p0'), 4, 'the other router counts them again')

    // Lost again with nothing written meanwhile: only resync() can know.
    await own.stop()
    await own.start()
    t.ok(await until(() => redis.status === 'ready'), 'reconnected')
    t.same(await redis.hgetall('handoff:leases:a'), {})
    await a.resync()
    t.equal(Object.keys(await redis.hgetall('handoff:leases:a')).length, 4, 'resync rewrote it')
    t.match(JSON.parse((await redis.hget('handoff:leases:a', r2.requestId)) ?? '{}'), { decode: 'd1', state: 'issued' })

    // resync while Redis is away: it rejects, and stays dirty for the next change.
    await own.stop()
    await t.rejects(a.resync(), { code: 'RTR_ERR_STORE_UNAVAILABLE' })
    t.ok(a.dirty)
    await own.start()
    t.ok(await until(() => redis.status === 'ready'), 'reconnected')
    await a.resync()
    t.notOk(a.dirty)
    t.equal(await b.unreadBy('p0'), 4)
  })
})
