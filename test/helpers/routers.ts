import type { Test } from 'tap'
import { freePort } from '../../common/ports.js'
import type { SpawnedService } from '../../common/spawn.js'
import { ADMIN, agentStatus, LEASE_S } from './event-log.js'
import { startEngine, startRouterProcess, within, type Engine } from './pd-agents.js'
import { startRedis, type LocalRedis } from './redis.js'

/*
 * Issue 10's scenarios (test/scenarios/routers-*.test.ts): two router processes on one real
 * redis-server, in front of simulators with transfer agents that know both routers.
 */

const fastHealth = { health: { intervalMs: 100, timeoutMs: 500, unhealthyThreshold: 2, baseEjectionMs: 200, maxEjectionMs: 1000 } }

export interface Fleet {
  redis: LocalRedis
  prefill: Engine
  decode: Engine
  routers: SpawnedService[]
}

/** Two routers on one Redis; agents list `order` of them (indexes) in their --router-url. */
export async function fleet(t: Test, order: [number, number] = [0, 1]): Promise<Fleet> {
  const redis = await startRedis(t)
  const ports = [await freePort(), await freePort()]
  const urls = ports.map((p) => `http://127.0.0.1:${p}`)
  const agentArgs = ['--router-url', order.map((i) => urls[i]).join(',')]
  const prefill = await startEngine(t, { role: 'prefill', leaseSeconds: LEASE_S, agentArgs })
  const decode = await startEngine(t, { role: 'decode', leaseSeconds: LEASE_S, simArgs: ['--kv-load-failure-policy', 'fail'], agentArgs })
  const store = { kind: 'redis', url: redis.url, memberTtlMs: 900 }
  const routers = []
  for (const port of ports) routers.push(await startRouterProcess(t, [prefill, decode], { port, adminToken: ADMIN, store, ...fastHealth }))
  const ms = await within(10_000, async () => (await Promise.all([prefill, decode].map(agentStatus))).every((s) => s.router.connected))
  t.ok(ms >= 0, `both agents follow the shared log (${Math.round(ms)} ms after the routers started)`)
  return { redis, prefill, decode, routers }
}
