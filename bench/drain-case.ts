import { setTimeout as sleep } from 'node:timers/promises'
import { request } from 'undici'
import { runPrestopHook, type HookRun } from './prestop-hook.js'
import { MODEL, type VllmEngine } from './vllm-engine.js'

/*
 * Issue 20's third timed case, one code path for `handoff bench connector` and
 * test/vllm/lease.test.ts: a vLLM prefiller with handoff's connector drained under load by the
 * chart's preStop hook. Clients keep sending through the router all along; the hook returns
 * once the router holds nothing of the prefiller (no request in flight, no unread lease), and
 * the router then logs peer_gone for its engine_id, on which the decoder's connector releases
 * that peer's NIXL state. Stock vLLM keeps it on D for engine_ttl (3600 s by default).
 */

export interface DrainCaseOptions {
  routerUrl: string
  adminToken: string
  /** The router's id of the prefiller to drain (the hook's --instance-id). */
  instanceId: string
  drained: VllmEngine
  decode: VllmEngine
  /** Concurrent clients, each sending one completion after another. */
  clients: number
  /** Load before the hook starts, so the prefiller has work in flight when it does. */
  leadMs: number
  prompt: () => string
  say?: (msg: string) => void
}

export interface DrainCase {
  hook: HookRun
  /** From the hook's start to its exit. */
  hookMs: number
  /** Requests sent through the router during the case, and how each failed one ended. */
  requests: number
  failures: string[]
  /**
   * Polled while the hook ran: ms from its start until the router showed the prefiller
   * draining (the hook's own start-up: a python3 process), the requests in flight there
   * then, and the most seen after (never more: a draining instance admits nothing new).
   */
  drainSeen: { afterMs: number; inflight: number; maxAfter: number } | undefined
  /** What the router held of the prefiller when the hook started. */
  heldAtStart: { inflight: number; unreadLeases: number }
  /** After the hook's exit until the drained engine held no KV block; NaN if not within 5 s. */
  kvFreedMs: number
  /** From the hook's start until D's connector released the drained peer; NaN if not within 30 s of its exit. */
  releasedMs: number
}

export async function drainUnderLoad(o: DrainCaseOptions): Promise<DrainCase> {
  const failures: string[] = []
  let requests = 0
  let stop = false
  const client = async (): Promise<void> => {
    while (!stop) {
      requests++
      try {
        const res = await request(`${o.routerUrl}/v1/completions`, {
          method: 'POST',
          body: JSON.stringify({ model: MODEL, prompt: o.prompt(), max_tokens: 8, temperature: 0 }),
          headers: { 'content-type': 'application/json' },
          headersTimeout: 120_000,
          bodyTimeout: 120_000,
        })
        const text = await res.body.text()
        if (res.statusCode !== 200) failures.push(`${res.statusCode} ${/"code":\s*"([A-Z_]+)"/.exec(text)?.[1] ?? text.slice(0, 120)}`)
      } catch (err) {
        failures.push((err as Error).name)
      }
    }
  }
  const released = (): Promise<number> => o.decode.metric('vllm:handoff_peers_released_total')

  const load = Promise.all(Array.from({ length: o.clients }, client))
  try {
    await sleep(o.leadMs)
    // The hook starts while the router holds something of the prefiller.
    let held = { inflight: 0, unreadLeases: 0 }
    for (const deadline = performance.now() + 20_000; performance.now() < deadline; await sleep(20)) {
      const { inflight, unreadLeases } = await holding(o)
      held = { inflight, unreadLeases }
      if (inflight + unreadLeases > 0) break
    }
    const releasedBefore = await released()
    o.say?.(`draining ${o.instanceId} with the preStop hook under ${o.clients} clients`)
    const started = performance.now()
    const running = runPrestopHook(['--router-url', o.routerUrl, '--instance-id', o.instanceId, '--deadline-seconds', '60', '--progress-seconds', '1'], { HANDOFF_ADMIN_TOKEN: o.adminToken })
    let drainSeen: DrainCase['drainSeen']
    while (running.running()) {
      const now = await holding(o)
      if (drainSeen) drainSeen.maxAfter = Math.max(drainSeen.maxAfter, now.inflight)
      else if (now.state !== 'ready') drainSeen = { afterMs: performance.now() - started, inflight: now.inflight, maxAfter: now.inflight }
      await sleep(20)
    }
    const hook = await running.done
    const kvFreedMs = Number.isNaN(await o.drained.msUntilNoKv(5000)) ? Number.NaN : performance.now() - hook.exitedAt
    let releasedMs = Number.NaN
    while (performance.now() - hook.exitedAt < 30_000) {
      if ((await released()) > releasedBefore) {
        releasedMs = performance.now() - started
        break
      }
      await sleep(20)
    }
    // Traffic goes on after the drain, on the prefillers left.
    await sleep(1000)
    stop = true
    await load
    return { hook, hookMs: hook.exitedAt - started, requests, failures, drainSeen, heldAtStart: held, kvFreedMs, releasedMs }
  } finally {
    stop = true
    await load
  }
}

/** What the router holds of the instance (requests in flight, leases not yet read) and its state ('gone' once removed). */
async function holding(o: DrainCaseOptions): Promise<{ inflight: number; unreadLeases: number; state: string }> {
  const auth = { authorization: `Bearer ${o.adminToken}` }
  const [leases, topology] = await Promise.all(
    [`/leases?instance=${encodeURIComponent(o.instanceId)}`, '/topology'].map(async (path) => (await request(`${o.routerUrl}${path}`, { headers: auth })).body.json()),
  )
  const unreadLeases = (leases as { byPrefill: Record<string, number> }).byPrefill[o.instanceId] ?? 0
  const view = (topology as { instances: { id: string; inflight: number; state: string }[] }).instances.find((i) => i.id === o.instanceId)
  return { inflight: view?.inflight ?? 0, unreadLeases, state: view?.state ?? 'gone' }
}
