import type { Test } from 'tap'
import { request } from 'undici'
import { freePort } from '../../common/ports.js'
import { post, spawnRouter, type RouterProcess } from './cluster.js'
import { ADMIN, admin, LEASE_S } from './event-log.js'
import { startFollower, type Follower } from './follower.js'
import { complete, completionBody, sleep, startEngine, type Engine, type Outcome } from './pd-agents.js'

/*
 * Issue 21's chaos cluster (test/chaos/suite.test.ts, sentinel.test.ts): real processes, as
 * production wires them. Two routers on one Redis, a prefiller and a decoder (simulators with
 * their transfer agents, following A then B and B then A) and two vLLM connector followers
 * (real Python processes, following A then B and B then A): four agents.
 *
 * `fault` runs one fault under traffic: ops declare a throwaway engine gone every 250 ms
 * through A and B in turn, three clients send completions through both. It prints one line
 * (`.ci/run` shows them) with the events answered 202, how many of them each agent applied
 * (its tombstone, or the event seen), and the requests answered, failed and hung; and asserts
 * that every event answered 202 reached every agent, that no request hung, and that none got
 * another prompt's text.
 */
const KEEPALIVE_MS = 1000
const HUNG_MS = 30_000
const APPLY_WITHIN_MS = 30_000

export interface ChaosCluster {
  a: RouterProcess
  b: RouterProcess
  /**
   * `afterMs`: traffic and ops go on this long after `inject` returned. `todo`: the reason the
   * applied counts are a known open defect (they are printed and checked, not yet required).
   */
  fault(name: string, inject: () => Promise<void>, opts?: { afterMs?: number; todo?: string }): Promise<void>
  /** Kills router A and starts it again at its port (a few tries: see restartAt). */
  restartA(): Promise<void>
}

/** `stores`: the store URL of router A and of router B. */
export async function chaosCluster(t: Test, stores: [string, string]): Promise<ChaosCluster> {
  const ports = [await freePort(), await freePort()] as [number, number]
  const [aUrl, bUrl] = ports.map((p) => `http://127.0.0.1:${p}`) as [string, string]
  const prefill = await startEngine(t, { role: 'prefill', leaseSeconds: LEASE_S, agentArgs: ['--router-url', `${aUrl},${bUrl}`] })
  const decode = await startEngine(t, { role: 'decode', leaseSeconds: LEASE_S, simArgs: ['--kv-load-failure-policy', 'fail'], agentArgs: ['--router-url', `${bUrl},${aUrl}`] })
  const config = (port: number, url: string) => ({
    port,
    adminToken: ADMIN,
    store: { kind: 'redis', url, memberTtlMs: 3000 },
    events: { keepAliveMs: KEEPALIVE_MS },
    instances: [
      { id: 'p0', role: 'prefill', url: prefill.sim.url },
      { id: 'd0', role: 'decode', url: decode.sim.url },
    ],
    health: { intervalMs: 200, timeoutMs: 1000, unhealthyThreshold: 3 },
  })
  const a = await spawnRouter(t, config(ports[0], stores[0]))
  const b = await spawnRouter(t, config(ports[1], stores[1]))
  const followers: [string, Follower][] = [
    ['follower 1', startFollower(t, { engineId: 'chaos-f1', routers: [aUrl, bUrl], token: 'unused', agentUrl: 'http://127.0.0.1:5611' })],
    ['follower 2', startFollower(t, { engineId: 'chaos-f2', routers: [bUrl, aUrl], token: 'unused', agentUrl: 'http://127.0.0.1:5612' })],
  ]
  const engines: [string, Engine][] = [
    ['prefill agent', prefill],
    ['decode agent', decode],
  ]

  /** Engine_ids a follower saw declared gone (events, and snapshots of a log it joined late). */
  const seenGone = (f: Follower): Set<string> => {
    const ids = new Set<string>()
    for (const l of f.lines) for (const id of [...(l.event?.engineIds ?? []), ...(l.event?.goneEngineIds ?? [])]) ids.add(id)
    return ids
  }
  const isGone = async (e: Engine, id: string): Promise<boolean> => {
    try {
      const res = await request(`${e.agent.url}/v1/peers/gone/${encodeURIComponent(id)}`, { headersTimeout: 5000, bodyTimeout: 5000 })
      return ((await res.body.json()) as { gone: boolean }).gone
    } catch {
      return false
    }
  }
  /** How many of `ids` each agent applied. */
  const applied = async (ids: readonly string[]): Promise<[string, number][]> => {
    const out: [string, number][] = []
    for (const [name, e] of engines) out.push([name, (await Promise.all(ids.map((id) => isGone(e, id)))).filter(Boolean).length])
    for (const [name, f] of followers) {
      const seen = seenGone(f)
      out.push([name, ids.filter((id) => seen.has(id)).length])
    }
    return out
  }

  let ghosts = 0
  /** Why the last declaration was not accepted. */
  let refusedWhy = ''
  /** Registers a throwaway engine at `url` and declares it gone there; its id once answered 202. */
  const declare = async (url: string, tag: string): Promise<string | undefined> => {
    const n = ghosts++
    const id = `ghost-${tag}-${n}`
    try {
      const reg = await post(`${url}/v1/agents`, { agentId: id, engineId: id, role: 'prefill', agentUrl: `http://127.0.0.1:${30_000 + n}` }, {}, HUNG_MS)
      if (reg.status !== 200) {
        refusedWhy = `registration ${reg.status} ${reg.text.slice(0, 300)}`
        return undefined
      }
      const res = await post(`${url}/fault_tolerance/event`, { event_type: 'peer_gone', nodes: { engine_ids: [id] } }, admin, HUNG_MS)
      if (res.status === 202 && res.json<{ logged: boolean }>().logged) return id
      refusedWhy = `peer_gone ${res.status} ${res.text.slice(0, 300)}`
      return undefined
    } catch (err) {
      refusedWhy = `${(err as Error).name}: ${(err as Error).message}`
      return undefined // the router is down: not accepted, nothing promised
    }
  }

  // Before any fault: every agent follows the log. A router may refuse an event (it answers
  // 503 while it cannot reach the log, as during the faults): a refusal promises nothing and
  // is counted as refused there; here the warm-up is declared again until one is accepted.
  // (Issue 38 item 1: a new machine's run got [0, 0, 0, 0] below, which is what an empty list
  // of accepted ids gives: the warm-up's refusal was taken for four agents that heard nothing.)
  let warm: string | undefined
  const refusals: string[] = []
  for (const until = Date.now() + 20_000; !warm && Date.now() < until; ) {
    warm = await declare(bUrl, 'warm')
    if (!warm) {
      refusals.push(refusedWhy)
      await sleep(250)
    }
  }
  if (refusals.length > 0) t.comment(`warm-up refused ${refusals.length} time(s) before one was accepted: ${refusals.slice(0, 3).join('; ')}`)
  t.ok(warm, 'a warm-up event was accepted', { refusals: refusals.slice(-3) })
  if (warm) {
    const deadline = Date.now() + 20_000
    while (Date.now() < deadline && (await applied([warm])).some(([, n]) => n < 1)) await sleep(200)
    t.same(
      (await applied([warm])).map(([, n]) => n),
      [1, 1, 1, 1],
      'before any fault, an event reaches all four agents',
      { stderr: followers.map(([, f]) => f.stderr().slice(-2000)) },
    )
  }

  let requestNo = 0
  const fault = async (name: string, inject: () => Promise<void>, { afterMs = 1500, todo }: { afterMs?: number; todo?: string } = {}): Promise<void> => {
    let stop = false
    const accepted: string[] = []
    let refused = 0
    const ops = (async () => {
      for (let k = 0; !stop; k++) {
        const id = await declare(k % 2 === 0 ? aUrl : bUrl, name.replace(/[^a-z0-9]+/gi, '-'))
        if (id) accepted.push(id)
        else refused++
        await sleep(250)
      }
    })()
    const outcomes: Outcome[] = []
    const client = async (n: number): Promise<void> => {
      for (let k = 0; !stop; k++) {
        const i = requestNo++
        const out = await complete(k % 2 === n % 2 ? aUrl : bUrl, completionBody(i, 'chaos', 8), i, HUNG_MS)
        outcomes.push(out)
        if (!out.ok) await sleep(100)
      }
    }
    const clients = [0, 1, 2].map(client)
    await sleep(1000)
    await inject()
    await sleep(afterMs)
    stop = true
    await Promise.all([ops, ...clients])

    const until = Date.now() + APPLY_WITHIN_MS
    let counts = await applied(accepted)
    while (Date.now() < until && counts.some(([, n]) => n < accepted.length)) {
      await sleep(250)
      counts = await applied(accepted)
    }
    const hung = outcomes.filter((o) => o.ms >= HUNG_MS - 100 || /Timeout/.test(o.code ?? '')).length
    const ok = outcomes.filter((o) => o.ok).length
    const wrong = outcomes.filter((o) => o.wrong).length
    t.comment(
      `chaos: ${name}: accepted ${accepted.length} (refused ${refused}), applied ${counts.map(([, n]) => n).join('/')} by each agent (${counts.map(([agent]) => agent).join(', ')}), requests ${ok} ok / ${outcomes.length - ok - hung} failed / ${hung} hung`,
    )
    t.ok(accepted.length > 0, `${name}: some events were accepted`)
    for (const [agent, n] of counts) t.equal(n, accepted.length, `${name}: the ${agent} applied every event answered 202`, todo ? { todo } : {})
    t.equal(hung, 0, `${name}: no request hung`)
    t.equal(wrong, 0, `${name}: no request got another prompt's text`)
    if (counts.some(([, n]) => n < accepted.length)) {
      t.comment(`router A:\n${a.service.output().slice(-3000)}\nrouter B:\n${b.service.output().slice(-3000)}`)
      for (const [follower, f] of followers) {
        const seen = f.lines.map((l) => (l.new_log ? 'new log' : l.event ? `${l.event.seq} ${l.event.type}${l.event.engineIds ? ` ${l.event.engineIds.join(',')}` : ''}` : '')).filter(Boolean)
        t.comment(`${follower}: ${f.stderr().slice(-2000)}\nwhat it printed, last 40: ${seen.slice(-40).join('; ')}`)
      }
    }
  }

  const restartA = async (): Promise<void> => {
    await a.crash()
    // A port from the ephemeral range can be taken by one of the agents' own connects to the
    // dead router (see helpers/event-log.ts): try again, as an orchestrator does.
    for (let attempt = 1; ; attempt++) {
      try {
        await a.restart()
        return
      } catch (err) {
        if (attempt >= 5) throw err
        await sleep(200)
      }
    }
  }
  return { a, b, fault, restartA }
}
