import t from 'tap'
import { Redis } from 'ioredis'
import { ManualClock } from '../../common/clock.js'
import { freePort } from '../../common/ports.js'
import { READER_BLOCK_MS, redactUrl, redisOptions, retryableRedisError, StoreConnection, type StoreState } from '../../router/src/store/connection.js'
import { startTcpProxy } from '../../bench/tcp-proxy.js'
import { waitFor } from '../helpers/cluster.js'
import { needRedis, startRedis } from '../helpers/redis.js'

t.test('redactUrl hides the password and nothing else', async (t) => {
  t.equal(redactUrl('redis://:s3cret@db.example:6380/2'), 'redis://:***@db.example:6380/2')
  t.equal(redactUrl('rediss://user:s3cret@db.example:6380'), 'rediss://user:***@db.example:6380')
  t.equal(redactUrl('redis://127.0.0.1:6379'), 'redis://127.0.0.1:6379')
  t.equal(redactUrl('not a url :s3cret@'), '<unparsable url>')
})

t.test('bad options are rejected in the constructor', async (t) => {
  t.throws(() => new StoreConnection({ url: 'http://x:1' }), RangeError)
  t.throws(() => new StoreConnection({ url: 'redis://x:1', commandTimeoutMs: 0 }), RangeError)
})

t.test('open() gives up after its timeout, naming the URL without its password', async (t) => {
  const port = await freePort()
  const clock = new ManualClock()
  const opening = StoreConnection.open({ url: `redis://:hunter2@127.0.0.1:${port}`, clock, connectTimeoutMs: 3000 })
  // Let it fail a connection or two first, so the error names the cause.
  await new Promise((r) => setTimeout(r, 200))
  clock.advance(3000)
  const err = (await opening.then(() => undefined, (e: unknown) => e)) as Error
  t.ok(err instanceof Error, 'rejects')
  t.match(err.message, `redis://:***@127.0.0.1:${port}`)
  t.match(err.message, /3000 ms/)
  t.notMatch(err.message, /hunter2/)
})

t.test('with a real Redis', { skip: needRedis(t) }, async (t) => {
  t.test('ok while connected, degraded in an outage (commands fail fast), ok again without a restart', async (t) => {
    const server = await startRedis(t)
    const up: number[] = []
    const changes: StoreState[] = []
    const conn = await StoreConnection.open({ url: server.url, commandTimeoutMs: 500, maxBackoffMs: 200, metrics: { up: { set: (v) => up.push(v) } } })
    t.teardown(() => conn.close())
    conn.onChange((s) => changes.push(s))
    t.equal(conn.state.state, 'ok')
    t.equal(conn.state.error, undefined)
    t.same(up, [0, 1], 'the gauge: 0 until connected, then 1')
    await conn.client.set('k', 'v')
    const reader = conn.duplicate()
    t.equal(await reader.get('k'), 'v', 'a duplicate reaches the same server')

    await server.stop()
    t.ok(await waitFor(() => conn.state.state === 'degraded', 5000), 'degraded once Redis is gone')
    t.type(conn.state.error, 'string', 'with the reason')
    t.ok(conn.state.since > 0)
    const started = Date.now()
    await t.rejects(conn.client.get('k'), 'a command during the outage fails')
    t.ok(Date.now() - started < 2000, 'fast, not queued until Redis is back')
    await t.rejects(reader.get('k'), 'on a duplicate too')

    await server.start()
    t.ok(await waitFor(() => conn.state.state === 'ok', 10_000), 'ok again once Redis is back')
    t.equal(await conn.client.set('k', 'w'), 'OK')
    t.ok(await waitFor(() => reader.status === 'ready', 10_000), 'the duplicate reconnects too')
    t.equal(await reader.get('k'), 'w')
    t.same(
      changes.map((c) => c.state),
      ['degraded', 'ok'],
      'one change each way',
    )
    t.same(up.slice(2), [0, 1])
  })

  t.test('a duplicate waits in blocking reads longer than the command timeout, client.duplicate() too', async (t) => {
    const server = await startRedis(t)
    const conn = await StoreConnection.open({ url: server.url, commandTimeoutMs: 100 })
    t.teardown(() => conn.close())
    for (const reader of [conn.duplicate(), conn.client.duplicate()]) {
      const started = Date.now()
      t.equal(await reader.xread('BLOCK', 400, 'STREAMS', 's', '$'), null, 'the BLOCK ran its course')
      t.ok(Date.now() - started >= 350, 'not cut at commandTimeoutMs')
    }
    await t.rejects(conn.client.xread('BLOCK', 400, 'STREAMS', 's', '$'), /timed out/, 'the command connection is cut')
  })

  t.test('a reader on a link that drops everything without a reset is dropped and opened again; degraded meanwhile (issue 21)', async (t) => {
    const server = await startRedis(t)
    const link = await startTcpProxy({ host: '127.0.0.1', port: server.port }, (stop) => t.teardown(stop))
    const lost: string[] = []
    const conn = await StoreConnection.open({ url: server.url, commandTimeoutMs: 200, maxBackoffMs: 200, metrics: { up: { set: () => {} }, lost: { inc: (l) => lost.push(l.connection) } } })
    t.teardown(() => conn.close())
    // The command connection goes straight to Redis; only the reader's link fails.
    const reader = conn.duplicate({ port: link.port })
    t.ok(await waitFor(() => reader.status === 'ready', 5000))
    t.equal(await reader.xread('BLOCK', 50, 'STREAMS', 's', '$'), null, 'it reads through the link')
    t.equal(conn.state.state, 'ok')
    link.blackhole()
    const started = Date.now()
    const err = await reader.xread('BLOCK', READER_BLOCK_MS, 'STREAMS', 's', '$').then(
      () => undefined,
      (e: unknown) => e,
    )
    const took = Date.now() - started
    t.type(err, Error, 'a read on the dead link fails, instead of ending as an empty block and leaving the socket in place')
    // Not cut short (a block is as long as it says), and not left to ioredis's own 60 s guard on blocking commands.
    t.ok(took >= READER_BLOCK_MS && took < 30_000, `once the link carried nothing for the block time plus the command timeout (${took} ms)`)
    t.equal(conn.state.state, 'degraded', 'the router is degraded: it would get no events')
    t.same(lost, ['reader'], 'the loss is counted once, for the reader')
    await new Promise((r) => setTimeout(r, 1500))
    t.same(lost, ['reader'], 'attempts to connect through the dead link are not counted again')
    link.heal()
    t.ok(await waitFor(() => reader.status === 'ready', 5000), 'the reader connects again once the link lets connections through')
    t.ok(await waitFor(() => conn.state.state === 'ok', 5000), 'ok again')
    t.equal(await reader.xread('BLOCK', 50, 'STREAMS', 's', '$'), null)
  })

  t.test('close() ends every connection, duplicates included, and reports nothing after', async (t) => {
    const server = await startRedis(t)
    const conn = await StoreConnection.open({ url: server.url })
    const changes: StoreState[] = []
    conn.onChange((s) => changes.push(s))
    const reader = conn.duplicate()
    const blocked = reader.xread('BLOCK', 0, 'STREAMS', 's', '$').catch((err: Error) => err)
    await waitFor(() => reader.status === 'ready')
    await conn.close()
    await conn.close()
    t.equal(conn.client.status, 'end')
    t.ok(await waitFor(() => reader.status === 'end', 2000), 'the duplicate is closed')
    t.type(await blocked, Error, 'a blocked read ends')
    t.same(changes, [])
    const late = conn.duplicate()
    t.ok(await waitFor(() => late.status === 'end', 2000), 'a duplicate taken after close() is closed at once')
  })
})

// Issue 21 item 6: which failures a decision waits out (the store away or failing over) and
// which would fail the same way every time (then it is dropped, not retried forever).
t.test('retryableRedisError: no answer, or an answer that passes; not a script error nor a bug', { skip: needRedis(t) }, async (t) => {
  const server = await startRedis(t)
  const redis = new Redis(server.port, '127.0.0.1', { maxRetriesPerRequest: 0, enableOfflineQueue: false })
  t.teardown(() => redis.disconnect())
  await new Promise((resolve) => redis.once('ready', resolve))
  const refusal = async (p: Promise<unknown>): Promise<unknown> => p.then(() => undefined, (err: unknown) => err)
  t.notOk(retryableRedisError(await refusal(redis.eval("return redis.error_reply('ERR broken')", 0))), 'a script error')
  t.notOk(retryableRedisError(await refusal(redis.eval('return nil +', 0))), 'a script that does not compile')
  t.notOk(retryableRedisError(new TypeError('x is undefined')), 'a bug of ours')
  t.ok(retryableRedisError(await refusal(redis.eval("return redis.error_reply('READONLY You can\\'t write against a read only replica.')", 0))), 'a replica not yet promoted')
  t.ok(retryableRedisError(await refusal(redis.eval("return redis.error_reply('LOADING Redis is loading the dataset in memory')", 0))), 'a server loading its data')
  await server.stop()
  t.ok(retryableRedisError(await refusal(redis.get('k'))), 'Redis gone')
})

// Issue 21 item 7: a redis+sentinel:// URL, and what it means to ioredis.
t.test('redisOptions: redis:// as it is; redis+sentinel:// as the sentinels, the master name, the db and the secrets', async (t) => {
  t.equal(redisOptions('redis://:pw@h:6379/2'), 'redis://:pw@h:6379/2')
  t.match(redisOptions('redis+sentinel://:s3cret@s1:26379,s2,[::1]:26380/mymaster/3?sentinelPassword=sp'), {
    sentinels: [
      { host: 's1', port: 26379 },
      { host: 's2', port: 26379 },
      { host: '::1', port: 26380 },
    ],
    name: 'mymaster',
    password: 's3cret',
    db: 3,
    sentinelPassword: 'sp',
  })
  t.match(redisOptions('rediss+sentinel://u:p@s1:1/m'), { username: 'u', password: 'p', enableTLSForSentinelMode: true, tls: {} })
  for (const bad of ['http://h', 'redis+sentinel://s1', 'redis+sentinel://s1:x/m', 'redis+sentinel:///m']) t.throws(() => redisOptions(bad), RangeError, bad)
  t.equal(redactUrl('redis+sentinel://:s3cret@s1:26379,s2/m?sentinelPassword=sp'), 'redis+sentinel://:***@s1:26379,s2/m?sentinelPassword=***')
})

t.test('through Sentinel: the master is found by name, and found again after a failover', { skip: needRedis(t) }, async (t) => {
  const master = await startRedis(t)
  const replica = await startRedis(t, { replicaOf: master.port })
  const sentinel = await startRedis(t, { sentinel: master.port })
  const conn = await StoreConnection.open({ url: `redis+sentinel://127.0.0.1:${sentinel.port}/mymaster`, commandTimeoutMs: 500, maxBackoffMs: 200 })
  t.teardown(() => conn.close())
  await conn.client.set('k', 'before')
  t.equal((await conn.client.info('server')).match(/tcp_port:(\d+)/)?.[1], String(master.port), 'the commands go to the master')
  // The replica has the key once it synced; then the master dies and Sentinel promotes it.
  const direct = new Redis(replica.port, '127.0.0.1')
  t.teardown(() => direct.disconnect())
  t.ok(await waitFor(async () => (await direct.get('k')) === 'before', 10_000), 'the replica synced')
  await master.stop()
  const promoted = await waitFor(async () => {
    try {
      await conn.client.set('k', 'after')
      return (await conn.client.info('server')).match(/tcp_port:(\d+)/)?.[1] === String(replica.port)
    } catch {
      return false
    }
  }, 30_000)
  t.ok(promoted, 'after the failover the same client writes to the promoted replica')
  t.equal(await direct.get('k'), 'after')
  t.equal(conn.state.state, 'ok', 'and the store is ok again')
})
