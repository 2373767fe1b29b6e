import { Redis } from 'ioredis'
import t from 'tap'
import { ManualClock } from '../../common/clock.js'
import { RedisEventStore } from '../../router/src/store/redis-event-store.js'
import { needRedis, startRedis } from '../helpers/redis.js'
import { eventStoreContract } from './event-store.contract.js'

// The Redis event store against the store contract, on a real redis-server; each case has its own key prefix.
t.test('the Redis event store', { skip: needRedis(t) }, async (t) => {
  const server = await startRedis(t)
  let cases = 0

  eventStoreContract(t, {
    shared: true,
    backing: async (t) => {
      const prefix = `test${++cases}:`
      return {
        open: async (opts) => {
          const redis = new Redis(server.port, '127.0.0.1', { lazyConnect: false })
          t.teardown(() => redis.quit())
          const store = await RedisEventStore.open({ ...opts, redis, prefix })
          t.teardown(() => store.close())
          return store
        },
      }
    },
  })

  // What only Redis has: other writers, trimming behind a slow reader, the keys it leaves.
  t.test('a reader that fell behind retention gets a snapshot in place of what it missed', async (t) => {
    const redis = new Redis(server.port, '127.0.0.1')
    t.teardown(() => redis.quit())
    const store = await RedisEventStore.open({ clock: new ManualClock(), redis, prefix: 'gap:', retention: 2 })
    t.teardown(() => store.close())
    const seen: { seq: number; type: string }[] = []
    store.subscribe((e) => seen.push(e))
    // Five events and the trim in one transaction: the blocked reader wakes to find only the last two.
    const tx = redis.multi().set('gap:events:seq', 5).zadd('gap:events:gone', 1, 'e1')
    for (let i = 1; i <= 5; i++) tx.xadd('gap:events', 'MAXLEN', 2, `${i}-0`, 'e', JSON.stringify({ type: 'peer_gone', engineIds: [`e${i}`], addresses: [], reason: 't', at: 1 }), 'x', '[]')
    await tx.exec()
    const deadline = Date.now() + 5000
    while (seen.length < 3 && Date.now() < deadline) await new Promise((r) => setTimeout(r, 5))
    t.match(seen, [{ seq: 3, type: 'snapshot' }, { seq: 4 }, { seq: 5 }])
  })

  t.test('waiting sets: one per held event with expected agents, each with an expiry', async (t) => {
    const redis = new Redis(server.port, '127.0.0.1')
    t.teardown(() => redis.quit())
    const store = await RedisEventStore.open({ clock: new ManualClock(), redis, prefix: 'keys:', retention: 2, waitingTtlMs: 60_000 })
    t.teardown(() => store.close())
    for (let i = 1; i <= 5; i++) await store.append({ type: 'lease_release', prefillEngineId: 'p', requestIds: [`r${i}`], reason: 't' }, ['a', 'b'])
    t.same((await redis.keys('keys:events:waiting:*')).sort(), ['keys:events:waiting:4', 'keys:events:waiting:5'], 'trimmed events take their sets with them')
    const ttl = await redis.pttl('keys:events:waiting:5')
    t.ok(ttl > 0 && ttl <= 60_000, 'with an expiry')
    await store.ack('a', 5)
    await store.ack('b', 4)
    t.same(await redis.keys('keys:events:waiting:*'), ['keys:events:waiting:5'], 'a delivered event leaves no set')
    t.same(await redis.hgetall('keys:acks'), { a: '5', b: '4' })
    t.equal(await redis.xlen('keys:events'), 2)
  })
})
