import { Redis } from 'ioredis'
import t from 'tap'
import { RedisEventStore } from '../../router/src/store/redis-event-store.js'
import { startRedis } from '../helpers/redis.js'
import { eventStoreContract } from './event-store.contract.js'

// The Redis event store against the store contract, on a real redis-server; each case has its own key prefix.
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
