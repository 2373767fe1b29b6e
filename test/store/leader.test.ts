import t from 'tap'
import { ManualClock, systemClock } from '../../common/clock.js'
import { StoreConnection } from '../../router/src/store/connection.js'
import { LeaderLock, type LeaderLockOptions, soleLeader } from '../../router/src/store/leader.js'
import { type Teardown, waitFor } from '../helpers/cluster.js'
import { needRedis, startRedis } from '../helpers/redis.js'

// Short terms keep the cases fast; bounds are generous for a loaded 2-core machine.
const TTL = 600
const INTERVAL = TTL / 3

// A fenced write: SET KEYS[1] ARGV[1], only while the caller leads.
const WRITE = `return redis.call('SET', KEYS[1], ARGV[1])`

t.test('soleLeader leads from start() to stop(), token 1', async (t) => {
  const sole = soleLeader()
  const seen: [boolean, number | undefined][] = []
  sole.onChange((lead, token) => seen.push([lead, token]))
  t.equal(sole.isLeader, false)
  await sole.start()
  await sole.start()
  t.equal(sole.isLeader, true)
  t.equal(sole.token, 1)
  await sole.stop()
  t.equal(sole.token, undefined)
  t.same(seen, [
    [true, 1],
    [false, undefined],
  ])
})

t.test('bad options are rejected in the constructor', async (t) => {
  const redis = {} as LeaderLockOptions['redis']
  t.throws(() => new LeaderLock({ redis, routerId: 'r', ttlMs: 0, clock: systemClock }), RangeError)
  t.throws(() => new LeaderLock({ redis, routerId: '', ttlMs: 300, clock: systemClock }), RangeError)
})

t.test('on a real Redis', { skip: needRedis(t) }, async (t) => {
  // A server per case: some cases stop it.
  const setup = async (t: Teardown) => {
    const redis = await startRedis(t)
    const conn = await StoreConnection.open({ url: redis.url, commandTimeoutMs: 200, maxBackoffMs: 100 })
    t.teardown(() => conn.close())
    const prefix = 'lead:'
    const lock = (routerId: string, clock: LeaderLockOptions['clock'] = systemClock) => {
      const l = new LeaderLock({ redis: conn.client, routerId, prefix, ttlMs: TTL, clock })
      t.teardown(() => l.stop())
      return l
    }
    return { server: redis, conn, prefix, lock }
  }

  t.test('two locks on one Redis: exactly one leads, the key names it, a term survives its renewals', async (t) => {
    const { conn, prefix, lock } = await setup(t)
    const a = lock('a')
    const b = lock('b')
    const changes: [string, boolean, number | undefined][] = []
    a.onChange((lead, token) => changes.push(['a', lead, token]))
    b.onChange((lead, token) => changes.push(['b', lead, token]))
    await a.start()
    await b.start()
    t.equal(a.isLeader, true, 'the first to start leads')
    t.equal(b.isLeader, false)
    t.equal(a.token, 1)
    t.equal(b.token, undefined)
    t.equal(await conn.client.get(`${prefix}leader`), 'a:1')
    const pttl = await conn.client.pttl(`${prefix}leader`)
    t.ok(pttl > 0 && pttl <= TTL, 'with a PX of the TTL')
    // Over several terms' worth of renewals, never two leaders and no change of hands.
    const until = Date.now() + 3 * TTL
    let both = 0
    while (Date.now() < until) {
      if (a.isLeader && b.isLeader) both++
      await new Promise((r) => setTimeout(r, 20))
    }
    t.equal(both, 0, 'never both')
    t.same(changes, [['a', true, 1]], 'a kept its term')
    t.equal(await conn.client.get(`${prefix}leader`), 'a:1')

    const fenced = await a.fenced([`${prefix}data`], ['from a'], WRITE)
    t.same(fenced, { applied: true, result: 'OK' }, 'the leader writes')
    t.same(await b.fenced([`${prefix}data`], ['from b'], WRITE), { applied: false, holder: null }, 'a follower does not even try')
    t.equal(await conn.client.get(`${prefix}data`), 'from a')

    await a.stop()
    t.equal(a.isLeader, false)
    t.ok(await waitFor(() => b.isLeader, 3 * TTL), 'stop() hands over at the next attempt')
    t.equal(b.token, 2, 'with a higher token')
    t.equal(await conn.client.get(`${prefix}leader`), 'b:2')
    t.same(changes.slice(1), [
      ['a', false, undefined],
      ['b', true, 2],
    ])
  })

  t.test('a paused leader: another takes over after its TTL with a higher token, and its fenced write is refused', async (t) => {
    const { conn, prefix, lock } = await setup(t)
    // `old` runs on a clock that stands still: no renewals, and to itself its term never ends
    // (a SIGSTOPped process, or a write sent just before the pause and delivered after it).
    const paused = new ManualClock({ wall: Date.now(), monotonic: systemClock.monotonic() })
    const old = lock('old', paused)
    const next = lock('next')
    await old.start()
    t.equal(old.token, 1)
    const started = Date.now()
    await next.start()
    t.ok(await waitFor(() => next.isLeader, TTL + INTERVAL + 3000), 'the other leads')
    const took = Date.now() - started
    t.ok(took >= TTL - 100, `not before the old term expired (${took} ms)`)
    t.ok(took <= TTL + INTERVAL + 1500, `within ttl + one attempt interval, plus slack (${took} ms)`)
    t.equal(next.token, 2, 'with a higher token')
    t.equal(old.isLeader, true, 'the paused one still believes it leads')

    const write = await old.fenced([`${prefix}data`], ['stale'], WRITE)
    t.same(write, { applied: false, holder: 'next:2' }, 'Redis refuses its write')
    t.equal(await conn.client.exists(`${prefix}data`), 0, 'nothing written')
    t.equal(old.isLeader, false, 'and the refusal ends its term')
    t.same(await next.fenced([`${prefix}data`], ['fresh'], WRITE), { applied: true, result: 'OK' })

    // It wakes up: its attempts find another leader; it follows.
    paused.advance(TTL)
    await waitFor(() => false, 3 * INTERVAL)
    t.equal(old.isLeader, false)
    t.equal(next.isLeader, true)
    t.equal(await conn.client.get(`${prefix}leader`), 'next:2')
  })

  t.test('a woken leader whose term was taken steps down at its first renewal', async (t) => {
    const { conn, prefix, lock } = await setup(t)
    const paused = new ManualClock({ wall: Date.now(), monotonic: systemClock.monotonic() })
    const old = lock('old', paused)
    const changes: boolean[] = []
    old.onChange((lead) => changes.push(lead))
    await old.start()
    // Its key expires while it sleeps; another router takes it.
    await conn.client.set(`${prefix}leader`, 'other:7', 'PX', 10_000)
    paused.advance(INTERVAL)
    t.ok(await waitFor(() => !old.isLeader, 3000), 'the renewal found another value')
    t.same(changes, [true, false])
  })

  t.test('fenced scripts keep their own KEYS/ARGV and their errors', async (t) => {
    const { prefix, lock } = await setup(t)
    const a = lock('a')
    await a.start()
    const echo = await a.fenced<string[]>([`${prefix}k1`, `${prefix}k2`], ['x', 2], `return {KEYS[1], KEYS[2], ARGV[1], ARGV[2], tostring(#KEYS + #ARGV)}`)
    t.same(echo, { applied: true, result: [`${prefix}k1`, `${prefix}k2`, 'x', '2', '4'] })
    await t.rejects(a.fenced([], [], `return redis.call('NOSUCHCOMMAND')`), 'a failing script rejects')
    t.equal(a.isLeader, true, 'and does not end the term')
  })

  t.test('an outage: the leader steps down at its TTL, nobody leads, and after Redis is back (empty) one leads again', async (t) => {
    const { server, conn, lock } = await setup(t)
    const a = lock('a')
    const b = lock('b')
    await a.start()
    await b.start()
    t.equal(a.isLeader, true)
    const before = a.token as number

    const stopped = Date.now()
    await server.stop()
    t.ok(await waitFor(() => conn.state.state === 'degraded', 5000), 'the connection is degraded')
    t.ok(await waitFor(() => !a.isLeader, TTL + 3000), 'the leader steps down')
    const after = Date.now() - stopped
    t.ok(after >= INTERVAL, `not at once: it still leads within its TTL (${after} ms)`)
    t.ok(after <= TTL + 1500, `within its TTL, plus slack (${after} ms)`)
    await waitFor(() => false, TTL)
    t.equal(a.isLeader || b.isLeader, false, 'nobody can acquire')

    await server.start()
    t.ok(await waitFor(() => conn.state.state === 'ok', 10_000), 'the connection is ok again')
    t.ok(await waitFor(() => a.isLeader || b.isLeader, 10_000), 'one leads again')
    t.ok(!(a.isLeader && b.isLeader))
    const token = (a.token ?? b.token) as number
    t.ok(token > before, `a higher token than before the outage, though Redis lost its counter (${before} → ${token})`)
  })

  t.test('on ManualClock: a leader cut off from Redis leads until exactly ttl after its last renewal was sent', async (t) => {
    const { server, lock } = await setup(t)
    const clock = new ManualClock({ wall: Date.now() })
    const a = lock('a', clock)
    const changes: boolean[] = []
    a.onChange((lead) => changes.push(lead))
    await a.start()
    t.equal(a.isLeader, true)
    await server.stop()
    clock.advance(TTL - 1)
    // The attempts in between fail (asynchronously); the term is still on.
    await waitFor(() => false, 100)
    t.equal(a.isLeader, true, 'one ms before the end of its term')
    clock.advance(1)
    t.equal(a.isLeader, false, 'at the end of its term')
    t.same(changes, [true, false], 'told once')
  })

  t.test('stop() releases the key only if still ours, and is safe to repeat', async (t) => {
    const { conn, prefix, lock } = await setup(t)
    const a = lock('a')
    await a.stop()
    await a.start()
    await conn.client.set(`${prefix}leader`, 'intruder:9')
    await a.stop()
    t.equal(await conn.client.get(`${prefix}leader`), 'intruder:9', 'another router’s key is left alone')
    await a.stop()
  })
})
