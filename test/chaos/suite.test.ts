import { Redis } from 'ioredis'
import t from 'tap'
import { startTcpProxy } from '../../bench/tcp-proxy.js'
import { chaosCluster } from '../helpers/chaos.js'
import { sleep } from '../helpers/pd-agents.js'
import { needRedis, startRedis } from '../helpers/redis.js'
import { needNixl, probeNixl } from '../native/helpers.js'

/*
 * Issue 21's chaos suite: every fault of the event plane, one after another on one cluster of
 * real processes (test/helpers/chaos.ts), each under traffic, with a line per fault. Router A
 * reaches its redis-server through a TCP proxy that can blackhole the link; B directly.
 * Sentinel's failover has its own cluster (sentinel.test.ts).
 */
const probe = await probeNixl()

t.test('chaos: every event answered 202 reaches every agent, whatever befalls Redis and the routers', { skip: needRedis(t) || needNixl(t, probe) }, async (t) => {
  t.setTimeout(300_000)
  const redis = await startRedis(t)
  const link = await startTcpProxy({ host: '127.0.0.1', port: redis.port }, (stop) => t.teardown(stop))
  const { a, fault, restartA } = await chaosCluster(t, [`redis://127.0.0.1:${link.port}`, redis.url])
  const client = (): Redis => new Redis(redis.port, '127.0.0.1', { lazyConnect: true, maxRetriesPerRequest: 1 })

  await fault('router SIGKILL and restart', restartA)
  await fault('Redis restarted empty', async () => {
    redis.forgetSnapshot()
    await redis.stop()
    await redis.start()
  })
  await fault('FLUSHALL', async () => {
    const c = client()
    await c.flushall()
    c.disconnect()
  })
  await fault('Redis restarted from an older RDB (same log id)', async () => {
    const c = client()
    await c.save()
    c.disconnect()
    // Events logged after the snapshot are what the restart loses.
    await sleep(1500)
    await redis.stop()
    await redis.start()
  })
  await fault('router↔Redis traffic dropped 4 s without a reset', async () => {
    link.blackhole()
    await sleep(4000)
    link.heal()
  })
  await fault('router SIGSTOPped 6.5 s', async () => {
    a.service.child.kill('SIGSTOP')
    try {
      await sleep(6500)
    } finally {
      a.service.child.kill('SIGCONT')
    }
  })
})
