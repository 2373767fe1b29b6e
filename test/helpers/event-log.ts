import type { Test } from 'tap'
import type { SpawnedService } from '../../common/spawn.js'
import { get, post } from './cluster.js'
import { startEngine, startRouterProcess, within, type Engine } from './pd-agents.js'

/*
 * What the event-log scenarios share (test/scenarios/events-*.test.ts with one router,
 * routers-*.test.ts with several): the admin token, the agents' view of their router link,
 * and whether an event reached every agent.
 */

export const LEASE_S = 10
export const ADMIN = 'admin-token-0123'
export const admin = { authorization: `Bearer ${ADMIN}` }
// Apply bound for one event: the stream is open, so this is one HTTP write and one ack.
export const APPLY_BOUND_MS = 2000

export interface Status {
  agentId: string
  engineId: string | null
  router: { url: string; connected: boolean; routerId: string | null; lastApplied: number; lastAcked: number }
}

export const agentStatus = async (e: Engine): Promise<Status> => (await get(`${e.agent.url}/v1/status`)).json()

/** Whether every expected agent applied `seq` (GET /fault_tolerance/events/:seq). */
export async function delivered(url: string, seq: number, agents: string[]): Promise<boolean> {
  const d = (await get(`${url}/fault_tolerance/events/${seq}`, admin)).json<{ applied: string[]; expected: string[] }>()
  return agents.every((a) => d.applied.includes(a) && d.expected.includes(a))
}

/**
 * A throwaway engine to declare gone: an agent registration nobody streams for. `port` is one
 * nothing listens on: the router never dials a ghost, it is only a name.
 */
export async function ghost(url: string, name: string, port: number): Promise<void> {
  const res = await post(url + '/v1/agents', { agentId: `ghost-${name}`, engineId: `ghost-${name}`, role: 'prefill', agentUrl: `http://127.0.0.1:${port}` })
  if (res.status !== 200) throw new Error(`ghost registration: ${res.status} ${res.text}`)
}

const fastHealth = { health: { intervalMs: 100, timeoutMs: 500, unhealthyThreshold: 1, baseEjectionMs: 200, maxEjectionMs: 1000 } }

/**
 * One router in memory in front of a prefiller and a (fail-policy) decoder whose agents follow
 * its log; `agentUrls` rewrites the agents' --router-url. `restart` starts it again at the same port.
 */
export async function cluster(t: Test, routerPort: number, agentUrls?: (routerUrl: string) => string) {
  const routerUrl = `http://127.0.0.1:${routerPort}`
  const agentArgs = ['--router-url', agentUrls ? agentUrls(routerUrl) : routerUrl]
  const prefill = await startEngine(t, { role: 'prefill', leaseSeconds: LEASE_S, agentArgs })
  const decode = await startEngine(t, { role: 'decode', leaseSeconds: LEASE_S, simArgs: ['--kv-load-failure-policy', 'fail'], agentArgs })
  const config = { port: routerPort, adminToken: ADMIN, ...fastHealth }
  const router = await startRouterProcess(t, [prefill, decode], config)
  // The agents keep dialling the dead router's port meanwhile, and a port from the ephemeral
  // range can be taken by one of those very connections (Linux lets a connect to a closed
  // local port succeed to itself): then the restart's listen finds it in use. Try again, as
  // an orchestrator restarting the router would; a fixed port like 8000 never meets this.
  const restart = async (): Promise<SpawnedService> => {
    for (let attempt = 1; ; attempt++) {
      try {
        return await startRouterProcess(t, [prefill, decode], config)
      } catch (err) {
        if (attempt >= 10 || !/EADDRINUSE/.test(String((err as Error).message))) throw err
        await new Promise((resolve) => setTimeout(resolve, 200))
      }
    }
  }
  const connected = await within(10_000, async () => (await Promise.all([prefill, decode].map(agentStatus))).every((s) => s.router.connected))
  t.ok(connected >= 0, `both agents follow the router's log (${Math.round(connected)} ms after it started)`)
  return { prefill, decode, router, restart }
}
