import { hostname } from 'node:os'
import t from 'tap'
import { ManualClock, systemClock } from '../../common/clock.js'
import { StoreConnection } from '../../router/src/store/connection.js'
import { type MemberInfo, Membership, type MembershipOptions } from '../../router/src/store/members.js'
import { type Teardown, waitFor } from '../helpers/cluster.js'
import { needRedis, startRedis } from '../helpers/redis.js'

// Short TTLs keep the cases fast; bounds are generous for a loaded 2-core machine.
const TTL = 400

interface Logged {
  level: 'info' | 'warn'
  msg: string
}

t.test('bad options are rejected in the constructor', async (t) => {
  const good: MembershipOptions = { redis: {} as MembershipOptions['redis'], routerId: 'r', ttlMs: 300, clock: systemClock }
  for (const bad of [{ ttlMs: 1 }, { ttlMs: 300.5 }, { routerId: '' }]) t.throws(() => new Membership({ ...good, ...bad }), RangeError, JSON.stringify(bad))
})

t.test('on a real Redis', { skip: needRedis(t) }, async (t) => {
  // A server per case: some cases stop it.
  const setup = async (t: Teardown) => {
    const redis = await startRedis(t)
    const conn = await StoreConnection.open({ url: redis.url, commandTimeoutMs: 200, maxBackoffMs: 100 })
    t.teardown(() => conn.close())
    const prefix = 'members:'
    const logs: Logged[] = []
    const logger = { info: (_: object, msg: string) => logs.push({ level: 'info', msg }), warn: (_: object, msg: string) => logs.push({ level: 'warn', msg }) }
    const member = (routerId: string, clock: MembershipOptions['clock'] = systemClock, url?: string) => {
      const m = new Membership({ redis: conn.client, routerId, prefix, ttlMs: TTL, clock, logger, ...(url !== undefined && { url }) })
      t.teardown(() => m.leave())
      return m
    }
    return { server: redis, conn, prefix, logs, member }
  }

  t.test('members see each other alive with their info; leave() removes one at once', async (t) => {
    const { conn, prefix, member } = await setup(t)
    const a = member('a', systemClock, 'http://a:8000')
    const b = member('b')
    t.equal(await a.join(), true)
    t.equal(await b.join(), true)
    t.equal(await a.join(), true, 'joining twice is harmless')
    t.same((await a.alive()).sort(), ['a', 'b'])
    t.same((await b.alive()).sort(), ['a', 'b'])
    const members = await b.members()
    const infoA = members.find((m) => m.routerId === 'a')?.info as MemberInfo
    t.match(infoA, { url: 'http://a:8000', pid: process.pid, host: hostname() })
    t.ok(infoA.startedAt > 0)
    t.notOk('url' in (members.find((m) => m.routerId === 'b')?.info ?? {}), 'no url when none was given')
    for (const m of members) t.ok(m.expiresAt > Date.now() - 1000 && m.expiresAt <= Date.now() + TTL + 1000, 'scored by its expiry')

    // Renewals keep them alive well past one TTL.
    await waitFor(() => false, 3 * TTL)
    t.same((await a.alive()).sort(), ['a', 'b'], 'still alive after several TTLs')
    t.same(await a.sweep(), [], 'nothing to sweep')

    t.equal(await b.leave(), true)
    t.equal(await b.leave(), true, 'leaving twice is harmless')
    t.same(await a.alive(), ['a'])
    t.equal(await conn.client.hexists(`${prefix}routers:info`, 'b'), 0, 'its info is gone too')
    t.equal(b.joined, false)
  })

  t.test('one stops renewing: after its TTL, two concurrent sweepers report it departed exactly once', async (t) => {
    const { conn, prefix, member } = await setup(t)
    const a = member('a')
    const c = member('c')
    // `b` runs on a clock that stands still: it announces itself once and never renews.
    const b = member('b', new ManualClock({ wall: Date.now() }), 'http://b:8000')
    await Promise.all([a.join(), b.join(), c.join()])
    const departed: [string, string, MemberInfo | undefined][] = []
    a.onDeparted((id, info) => departed.push(['a', id, info]))
    c.onDeparted((id, info) => departed.push(['c', id, info]))
    t.same(await a.sweep(), [], 'b is alive within its TTL')

    t.ok(await waitFor(async () => !(await a.alive()).includes('b'), TTL + 3000), 'b is no longer alive after its TTL')
    t.same((await a.alive()).sort(), ['a', 'c'])
    const [fromA, fromC] = await Promise.all([a.sweep(), c.sweep()])
    t.same([...fromA, ...fromC], ['b'], 'one sweeper reports it')
    t.equal(departed.length, 1, 'one listener call in all')
    t.match(departed[0], [/^[ac]$/, 'b', { url: 'http://b:8000', pid: process.pid }])
    t.same(await a.sweep(), [], 'and nobody again')
    t.equal(await conn.client.zscore(`${prefix}routers`, 'b'), null)
    t.equal(await conn.client.hexists(`${prefix}routers:info`, 'b'), 0)
  })

  t.test('a sweeper never reports itself, and a listener that throws does not stop the others', async (t) => {
    const { conn, prefix, member, logs } = await setup(t)
    const a = member('a')
    await conn.client.zadd(`${prefix}routers`, 1, 'a', 2, 'x', 3, 'y')
    const seen: string[] = []
    a.onDeparted(() => {
      throw new Error('boom')
    })
    const off = a.onDeparted((id) => seen.push(id))
    t.same(await a.sweep(), ['x', 'y'])
    t.same(seen, ['x', 'y'])
    t.ok(logs.some((l) => l.level === 'warn' && /listener failed/.test(l.msg)))
    t.equal(await conn.client.zscore(`${prefix}routers`, 'a'), '1', 'its own expired entry is left to its renewal')
    off()
  })

  t.test('a Redis outage: renewals fail quietly (one warning), resume when it is back, and a member away past its TTL re-joins', async (t) => {
    const { server, conn, member, logs } = await setup(t)
    const a = member('a')
    await a.join()
    await server.stop()
    t.ok(await waitFor(() => conn.state.state === 'degraded', 5000))
    // Several renewal intervals into the outage.
    await waitFor(() => false, 2 * TTL)
    await t.rejects(a.alive(), 'reads fail fast while Redis is away')
    await t.rejects(a.sweep(), 'so do sweeps')
    t.equal(logs.filter((l) => l.level === 'warn').length, 1, 'one warning for the whole outage')

    // Back, empty: everything it had announced is gone; its next renewal re-joins it.
    await server.start()
    t.ok(await waitFor(async () => (await a.alive().catch((): string[] => [])).includes('a'), 10_000), 'alive again without a restart')
    t.ok(await waitFor(() => logs.some((l) => /again/.test(l.msg))), 'recovery logged')
    t.match((await a.members())[0], { routerId: 'a', info: { pid: process.pid } }, 'with its info')
    t.equal(logs.filter((l) => l.level === 'warn').length, 1)
  })

  t.test('a member that was swept while away is told so when its renewal re-joins it', async (t) => {
    const { member, logs } = await setup(t)
    const clock = new ManualClock({ wall: Date.now() })
    const b = member('b', clock)
    const a = member('a')
    await Promise.all([a.join(), b.join()])
    t.ok(await waitFor(async () => (await a.sweep()).includes('b'), TTL + 3000), 'swept')
    clock.advance(TTL)
    t.ok(await waitFor(async () => (await a.alive()).includes('b'), 3000), 'b re-joins with its next renewal')
    t.ok(logs.some((l) => /re-joined/.test(l.msg)))
  })

  t.test('leave() when Redis is away returns false; the entry then expires by itself', async (t) => {
    const { server, member } = await setup(t)
    const a = member('a')
    await a.join()
    await server.stop()
    t.equal(await a.leave(), false)
  })

  // Issue 21 item 6: expiry on the Redis server's clock. Before, scores were each router's
  // wall clock: a sweeper two minutes ahead saw every other router departed at once.
  t.test('a router whose wall clock is two minutes off neither sweeps live routers nor is swept', async (t) => {
    const { member } = await setup(t)
    const skewed = (ms: number): MembershipOptions['clock'] => ({ ...systemClock, now: () => Date.now() + ms })
    const ahead = member('ahead', skewed(120_000))
    const behind = member('behind', skewed(-120_000))
    const a = member('a')
    await Promise.all([ahead.join(), behind.join(), a.join()])
    await waitFor(() => false, 2 * TTL)
    for (const m of [ahead, behind, a]) {
      t.same(await m.sweep(), [], `${m.routerId} sweeps nobody`)
      t.same((await m.alive()).sort(), ['a', 'ahead', 'behind'], `${m.routerId} sees all three alive`)
    }
    await behind.leave()
    await ahead.leave()
    t.same(await a.alive(), ['a'])
  })
})
