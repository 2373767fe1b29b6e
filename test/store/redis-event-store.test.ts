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

  // Issue 21 item 6: an ack that jumps over thousands of events visits only those still
  // waiting for its agent (one ACK over 10,000 events took 12-122 ms of Redis time, a loop per
  // sequence). Counted in Redis's own command statistics, not timed.
  t.test('an ack visits only the events still waiting for its agent, however far it jumps', async (t) => {
    const redis = new Redis(server.port, '127.0.0.1')
    t.teardown(() => redis.quit())
    const delivered: number[] = []
    const store = await RedisEventStore.open({ clock: new ManualClock(), redis, prefix: 'wide:', onDelivered: (e) => delivered.push(e.seq) })
    t.teardown(() => store.close())
    const N = 2000
    for (let i = 1; i <= N; i++) await store.append({ type: 'lease_release', prefillEngineId: 'p', requestIds: [`r${i}`], reason: 't' }, ['p'])
    const calls = async (): Promise<number> => {
      const info = await redis.info('commandstats')
      let n = 0
      for (const m of info.matchAll(/^cmdstat_(\w+):calls=(\d+)/gm)) if (m[1] !== 'info' && m[1] !== 'config') n += Number(m[2])
      return n
    }
    await redis.config('RESETSTAT')
    await store.ack('d', N)
    const byOther = await calls()
    t.ok(byOther < 20, `an agent no event waits for acknowledges all ${N}: ${byOther} Redis commands`)
    await redis.config('RESETSTAT')
    await store.ack('p', N)
    t.equal(delivered.length, N, 'the agent they wait for completes every one')
    const byOwner = await calls()
    t.ok(byOwner < 6 * N, `with a handful of commands each (${byOwner} for ${N})`)
    t.equal(await redis.exists('wide:events:pending:' + (await redis.hkeys('wide:events:rosters'))[0]), 0, 'nothing waits any more')
    t.same(await redis.hgetall('wide:events:left'), {})
  })

  // Issue 21 items 2 and 3: a log that lost its data under the routers (FLUSHALL, a restart
  // from an older snapshot) is noticed by the next append or the next quiet read round, renamed,
  // and gets again what this router logged and did not see delivered.
  t.test('a log that lost its data: renamed, and what was not delivered is logged again', async (t) => {
    const redis = new Redis(server.port, '127.0.0.1')
    t.teardown(() => redis.quit())
    const resets: string[] = []
    const open = async () => {
      const store = await RedisEventStore.open({ clock: new ManualClock(), redis, prefix: 'lost:', onReset: (id, why) => resets.push(`${id} ${why}`) })
      t.teardown(() => store.close())
      return store
    }
    const store = await open()
    const other = await open()
    const release = (r: string) => ({ type: 'lease_release' as const, prefillEngineId: 'p', requestIds: [r], reason: 't' })
    const logged = async (): Promise<string[]> => (await store.since(0)).flatMap((e) => (e.type === 'lease_release' ? e.requestIds : []))
    await store.append(release('r1'), ['a'])
    await store.append(release('r2'), ['a'])
    await store.ack('a', 1)
    const first = store.id

    // Keys lost without a disconnect: the next append finds no id.
    await redis.del('lost:events', 'lost:events:id', 'lost:events:seq')
    const third = await store.append(release('r3'), ['a'])
    t.not(store.id, first, 'the append found the id gone: a new log')
    t.same(await logged(), ['r2', 'r3'], 'r2 (never acknowledged) logged again before r3; r1 (delivered) not')
    t.equal(third.seq, 2, 'the answer names its sequence in the new log')
    const deadline = Date.now() + 5000
    while (other.id !== store.id && Date.now() < deadline) await new Promise((r) => setTimeout(r, 20))
    t.equal(other.id, store.id, 'the other router took up the new log on its next read round, without renaming it again')

    // The same id, a sequence behind what was seen (a restart from an older snapshot).
    const second = store.id
    await redis.multi().xdel('lost:events', '2-0').call('XSETID', 'lost:events', '1-0').set('lost:events:seq', 1).exec()
    await store.append(release('r4'), ['a'])
    t.not(store.id, second, 'a sequence behind: the same id names another history, so a new log')
    t.same(await logged(), ['r2', 'r2', 'r3', 'r4'], 'what the rolled-back log kept (r2), r2 and r3 again (never acknowledged), then r4')

    // Nothing appended: a quiet read round notices the flush.
    const third_ = store.id
    await redis.flushdb()
    while (store.id === third_ && Date.now() < deadline + 5000) await new Promise((r) => setTimeout(r, 20))
    t.not(store.id, third_, 'a read round noticed the flush')
    while ((await logged()).length < 3 && Date.now() < deadline + 10_000) await new Promise((r) => setTimeout(r, 20))
    t.same((await logged()).sort(), ['r2', 'r3', 'r4'], 'and logged again what was not delivered')
    t.ok(resets.length >= 3, `each change was reported (${resets.length})`)
  })

  t.test('a replay that fails mid-way keeps the order: a peer_alive is never logged before its peer_gone (issue 37 item 4)', async (t) => {
    const redis = new Redis(server.port, '127.0.0.1')
    t.teardown(() => redis.quit())
    const store = await RedisEventStore.open({ clock: new ManualClock(), redis, prefix: 'order:' })
    t.teardown(() => store.close())
    await store.appendPeerGone({ type: 'peer_gone', engineIds: ['e1'], addresses: [], reason: 'restarted' }, ['a'])
    await store.appendPeerAlive({ type: 'peer_alive', engineIds: ['e1'], reason: 'answered again' }, ['a'])
    t.same((await store.snapshot()).goneEngineIds, [], 'before: e1 gone, then alive again')

    // The log loses its data; the first replayed event's script fails once (Redis went away for it).
    await redis.del('order:events', 'order:events:id', 'order:events:seq', 'order:events:gone')
    const evalOnce = redis.eval.bind(redis) as (...args: unknown[]) => Promise<unknown>
    let failed = 0
    ;(redis as unknown as { eval: (...args: unknown[]) => Promise<unknown> }).eval = (...args) => {
      if (failed === 0 && args.some((a) => typeof a === 'string' && a.includes('"type":"peer_gone"'))) {
        failed++
        return Promise.reject(new Error('connection lost'))
      }
      return evalOnce(...args)
    }
    await t.rejects(store.append({ type: 'lease_release', prefillEngineId: 'p', requestIds: ['r1'], reason: 't' }, ['a']), /connection lost/, 'the append that found the new log met the failed replay')
    t.equal(failed, 1)
    // A quiet read round replays the rest.
    const types = async () => (await store.since(0)).filter((e) => e.type === 'peer_gone' || e.type === 'peer_alive').map((e) => e.type)
    const deadline = Date.now() + 10_000
    while ((await types()).length < 2 && Date.now() < deadline) await new Promise((r) => setTimeout(r, 50))
    t.same(await types(), ['peer_gone', 'peer_alive'], 'replayed in the order they were logged')
    t.same((await store.snapshot()).goneEngineIds, [], 'e1 is alive, not tombstoned')
  })
})
