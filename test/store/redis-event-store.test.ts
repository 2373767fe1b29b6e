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

  t.test('rosters: one per distinct agent list, gone with the last held event that has it (issue 18 item 3)', async (t) => {
    const redis = new Redis(server.port, '127.0.0.1')
    t.teardown(() => redis.quit())
    const store = await RedisEventStore.open({ clock: new ManualClock(), redis, prefix: 'keys:', retention: 2 })
    t.teardown(() => store.close())
    const release = (i: number) => ({ type: 'lease_release' as const, prefillEngineId: 'p', requestIds: [`r${i}`], reason: 't' })
    for (let i = 1; i <= 5; i++) await store.append(release(i), ['a', 'b'])
    const rosters = async () => (await redis.keys('keys:events:roster*')).filter((k) => k !== 'keys:events:rosters').sort()
    t.equal((await rosters()).length, 2, 'five events for the same agents: one roster (a set and its list)')
    t.same(await redis.hgetall('keys:events:left'), { 4: '2', 5: '2' }, 'trimmed events take their counts with them')
    await store.ack('a', 5)
    await store.ack('b', 4)
    t.same(await redis.hgetall('keys:events:left'), { 5: '1' }, 'a delivered event leaves no count')
    t.same(await redis.hgetall('keys:acks'), { a: '5', b: '4' })
    await store.append(release(6), ['c'])
    await store.append(release(7), ['c'])
    t.equal((await rosters()).length, 2, "the last events for a and b went: so did their roster; c's is there")
    t.equal(await redis.get('keys:events:tracked'), '1')
    t.equal(await redis.xlen('keys:events'), 2)
    t.same(await redis.keys('keys:events:waiting:*'), [], 'no per-event sets')
  })

  t.test('entries logged before rosters are still delivered and trimmed', async (t) => {
    const redis = new Redis(server.port, '127.0.0.1')
    t.teardown(() => redis.quit())
    const event = JSON.stringify({ type: 'lease_release', prefillEngineId: 'p', requestIds: ['r'], reason: 't', at: 1 })
    await redis.multi().set('old:events:seq', 1).xadd('old:events', '1-0', 'e', event, 'x', '["a","b"]').sadd('old:events:waiting:1', 'a', 'b').exec()
    const delivered: number[] = []
    const store = await RedisEventStore.open({ clock: new ManualClock(), redis, prefix: 'old:', retention: 1, onDelivered: (e) => delivered.push(e.seq) })
    t.teardown(() => store.close())
    t.same(await store.delivery(1), { seq: 1, type: 'lease_release', engineIds: ['p'], expected: ['a', 'b'], applied: [] })
    t.equal(await store.undelivered(new Set(['a'])), 1)
    await store.ack('a', 1)
    await store.ack('b', 1)
    t.same(delivered, [1])
    await store.append({ type: 'lease_release', prefillEngineId: 'p', requestIds: ['r2'], reason: 't' }, ['a'])
    t.same(await redis.keys('old:events:waiting:*'), [])
    t.equal(await redis.xlen('old:events'), 1)
  })
})
