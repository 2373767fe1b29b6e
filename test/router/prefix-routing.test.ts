import t, { type Test } from 'tap'
import type { InstanceConfig } from '../../schemas/router-config.js'
import { get, post, startRouter, startSim, waitFor, type RouterOverrides } from '../helpers/cluster.js'

/*
 * Issue 39 part 3: prefix-aware selection on the router's index of the engines' KV events.
 * Real simulator processes publish their blocks as vLLM 0.32 does and tokenize as vLLM's
 * /tokenize does; which engine served a prompt is read from the engines themselves (P's
 * cached_tokens in the answer's usage, each engine's own vllm: counters).
 */

const MODEL = 'handoff/sim-1'
const words = (seed: string, n: number): string => Array.from({ length: n }, (_, i) => `${seed}${i}`).join(' ')
const EVENTS = JSON.stringify({ enable_kv_cache_events: true, endpoint: 'tcp://*:0', replay_endpoint: 'tcp://*:0' })
const SIM = ['--num-gpu-blocks-override', '512', '--enable-prompt-tokens-details', '--kv-events-config', EVENTS]
/** Decode-only off: the cases that look at P's choice (a decoder holding the shared prefix would serve alone). */
const PD_ONLY = { decodeOnly: { maxUncachedTokens: 0, maxPromptTokens: 0 } }

interface SimInfo {
  kvEvents: { endpoint: string; replayEndpoint: string | null; sequence: number }
}
type Sim = Awaited<ReturnType<typeof startSim>>

/** Two prefillers and two decoders publishing KV events, shared by the cases (each case has its own router). */
async function fleet(t: Parameters<typeof startSim>[0]): Promise<{ sims: Record<string, Sim>; instances: InstanceConfig[] }> {
  const roles = { p1: 'prefill', p2: 'prefill', d1: 'decode', d2: 'decode' } as const
  const sims: Record<string, Sim> = {}
  const instances: InstanceConfig[] = []
  for (const [id, role] of Object.entries(roles)) {
    const sim = await startSim(t, ['--role', role, ...SIM])
    const info = (await get(`${sim.url}/sim/info`)).json<SimInfo>().kvEvents
    sims[id] = sim
    instances.push({ id, role, url: sim.url, kvEvents: { endpoint: info.endpoint, ...(info.replayEndpoint ? { replayEndpoint: info.replayEndpoint } : {}) } } as InstanceConfig)
  }
  return { sims, instances }
}

/** One of an engine's own counters (summed over its labels). */
async function counter(sim: Sim, name: string): Promise<number> {
  const text = (await get(`${sim.url}/metrics`)).text
  let n = 0
  for (const m of text.matchAll(new RegExp(`^${name}(?:\\{[^}]*\\})? (\\S+)$`, 'gm'))) n += Number(m[1])
  return n
}

const served = (sim: Sim): Promise<number> => counter(sim, 'vllm:request_success_total')
const cachedOf = (r: { json<T>(): T }): number => r.json<{ usage: { prompt_tokens_details?: { cached_tokens?: number } } }>().usage.prompt_tokens_details?.cached_tokens ?? 0

async function router(t: Test, instances: InstanceConfig[], routing: RouterOverrides['routing'] = {}) {
  const r = await startRouter(t, instances, { probe: false, routing })
  // ZMQ subscribes asynchronously: give the feeds a moment before the first batch.
  t.ok(await waitFor(() => r.app.kv.following.length === instances.length), 'the router follows every engine')
  await new Promise((resolve) => setTimeout(resolve, 200))
  return r
}

/** Waits until the router's index holds what every engine has published so far. */
async function caughtUp(app: Awaited<ReturnType<typeof startRouter>>['app'], sims: Record<string, Sim>): Promise<boolean> {
  return waitFor(async () => {
    for (const [id, sim] of Object.entries(sims)) {
      const published = (await get(`${sim.url}/sim/info`)).json<SimInfo>().kvEvents.sequence
      if (published > 0 && (await app.kv.feed(id))?.sequence !== BigInt(published - 1)) return false
    }
    return true
  })
}

t.test('prefix-aware routing on the engines’ KV events', async (t) => {
  const { sims, instances } = await fleet(t)
  const p1 = sims.p1 as Sim
  const p2 = sims.p2 as Sim

  await t.test('a shared system prompt lands on the prefiller that holds it; the load policy spreads it', async (t) => {
    const { url, app } = await router(t, instances, PD_ONLY)
    const system = words('sys-a', 96)
    const first = await post(`${url}/v1/completions`, { model: MODEL, prompt: `${system} ${words('u0', 20)}`, max_tokens: 2 })
    t.equal(first.status, 200, first.text)
    t.ok(await caughtUp(app, sims))
    const before = [await served(p1), await served(p2)]
    const cached: number[] = []
    for (let i = 1; i <= 12; i++) {
      const r = await post(`${url}/v1/completions`, { model: MODEL, prompt: `${system} ${words(`u${i}`, 20)}`, max_tokens: 2 })
      t.equal(r.status, 200, r.text)
      cached.push(cachedOf(r))
      t.ok(await caughtUp(app, sims))
    }
    const after = [(await served(p1)) - (before[0] as number), (await served(p2)) - (before[1] as number)]
    t.ok(after.includes(12) && after.includes(0), `every request went to one prefiller (p1 ${after[0]}, p2 ${after[1]})`)
    t.ok(
      cached.every((c) => c >= 96),
      `and each found the system prompt cached there (cached_tokens ${cached.join(', ')})`,
    )
    const metrics = (await get(`${url}/metrics`)).text
    t.match(metrics, /^handoff_router_routing_choices_total\{leg="prefill",reason="prefix"\} 1[2-3]$/m, 'counted as prefix choices')
    t.match(metrics, /^handoff_router_tokenize_total\{outcome="tokenized"\} [1-9]/m, 'the engine tokenized the prompts')

    // The same prompts, another system prompt, on a router that routes on load alone.
    const load = await router(t, instances, { policy: 'load' })
    const other = words('sys-b', 96)
    const base = [await served(p1), await served(p2)]
    let hits = 0
    for (let i = 0; i < 12; i++) {
      const r = await post(`${load.url}/v1/completions`, { model: MODEL, prompt: `${other} ${words(`v${i}`, 20)}`, max_tokens: 2 })
      if (cachedOf(r) >= 96) hits++
    }
    const spread = [(await served(p1)) - (base[0] as number), (await served(p2)) - (base[1] as number)]
    t.ok(spread.every((n) => n > 0), `load alone spreads them (p1 ${spread[0]}, p2 ${spread[1]})`)
    t.ok(hits < 11, `and fewer find the prefix cached (${hits} of 12, against 12 of 12)`)
    t.notMatch((await get(`${load.url}/metrics`)).text, /^handoff_router_tokenize_total\{/m, 'and never tokenizes')
  })

  await t.test('cold prompts spread over the prefillers', async (t) => {
    const { url, app } = await router(t, instances)
    const before = [await served(p1), await served(p2)]
    for (let i = 0; i < 16; i++) {
      const r = await post(`${url}/v1/completions`, { model: MODEL, prompt: words(`cold${i}-`, 80), max_tokens: 2 })
      t.equal(r.status, 200)
      t.ok(await caughtUp(app, sims))
    }
    const n = [(await served(p1)) - (before[0] as number), (await served(p2)) - (before[1] as number)]
    t.ok(n.every((k) => k > 0), `both prefillers served some (p1 ${n[0]}, p2 ${n[1]})`)
    t.match((await get(`${url}/metrics`)).text, /^handoff_router_routing_choices_total\{leg="prefill",reason="cold"\} 1[0-9]$/m, 'counted as cold')
  })

  await t.test('the load guard: a holder with more in flight than the bound is not chosen for its cache', async (t) => {
    // No weight on load, no slack: only the guard keeps a busy holder from winning.
    const { url, app } = await router(t, instances, { ...PD_ONLY, loadGuard: { ratio: 1, slack: 0 }, prefill: { loadWeight: 0 } })
    const system = words('sys-c', 96)
    const p1Before = await served(p1)
    t.equal((await post(`${url}/v1/completions`, { model: MODEL, prompt: `${system} first`, max_tokens: 2 })).status, 200)
    t.ok(await caughtUp(app, sims))
    const holder = (await served(p1)) > p1Before ? p1 : p2
    const other = holder === p1 ? p2 : p1
    // The holder's next prefill stalls 3 s: one request in flight there, none on the other.
    await post(`${holder.url}/sim/faults`, { stallRate: 1, stallMs: 3000 })
    t.teardown(() => post(`${holder.url}/sim/faults`, { stallRate: 0 }))
    const stalled = post(`${url}/v1/completions`, { model: MODEL, prompt: `${system} stalled`, max_tokens: 2 })
    const holderId = holder === p1 ? 'p1' : 'p2'
    t.ok(await waitFor(() => app.topology.snapshot().instances.find((i) => i.id === holderId)?.inflight === 1), 'the holder has one request in flight')
    const before = await served(other)
    const r = await post(`${url}/v1/completions`, { model: MODEL, prompt: `${system} guarded`, max_tokens: 2 })
    t.equal(r.status, 200)
    t.equal((await served(other)) - before, 1, 'the next request with the same prefix went to the other prefiller')
    t.equal((await stalled).status, 200, 'the stalled one is answered too')
  })

  await t.test('two routers, no shared store: each follows every engine, so both send a shared prompt where it is', async (t) => {
    // Each router indexes the engines' own events, so what one router routed the other knows of.
    const a = await router(t, instances, PD_ONLY)
    const b = await router(t, instances, PD_ONLY)
    const system = words('sys-two', 96)
    const before = [await served(p1), await served(p2)]
    const first = await post(`${a.url}/v1/completions`, { model: MODEL, prompt: `${system} ${words('w0', 20)}`, max_tokens: 2 })
    t.equal(first.status, 200, first.text)
    t.ok((await caughtUp(a.app, sims)) && (await caughtUp(b.app, sims)), 'both indexes caught up')
    const cached: number[] = []
    for (let i = 1; i <= 10; i++) {
      const via = i % 2 === 0 ? a : b
      const r = await post(`${via.url}/v1/completions`, { model: MODEL, prompt: `${system} ${words(`w${i}`, 20)}`, max_tokens: 2 })
      t.equal(r.status, 200, r.text)
      cached.push(cachedOf(r))
      t.ok((await caughtUp(a.app, sims)) && (await caughtUp(b.app, sims)))
    }
    const n = [(await served(p1)) - (before[0] as number), (await served(p2)) - (before[1] as number)]
    t.ok(n.includes(11) && n.includes(0), `all 11 on one prefiller, whichever router took them (p1 ${n[0]}, p2 ${n[1]})`)
    t.ok(cached.every((c) => c >= 96), `and each found the system prompt cached (cached_tokens ${cached.join(', ')})`)
    t.match((await get(`${b.url}/metrics`)).text, /^handoff_router_routing_choices_total\{leg="prefill",reason="prefix"\} 5$/m, 'the router that never routed the first chose by prefix too')
  })

  await t.test('a conversation’s next turn goes decode-only to the decoder that decoded the last', async (t) => {
    const { url, app, logs } = await router(t, instances)
    const d = [sims.d1 as Sim, sims.d2 as Sim]
    const before = await Promise.all([...d, p1, p2].map(served))
    const messages: { role: string; content: string }[] = [{ role: 'system', content: words('chat-sys', 60) }]
    let last = ''
    for (let turn = 0; turn < 6; turn++) {
      messages.push({ role: 'user', content: words(`turn${turn}-`, 24) })
      const r = await post(`${url}/v1/chat/completions`, { model: MODEL, messages, max_tokens: 8, temperature: 0 })
      t.equal(r.status, 200, r.text)
      last = r.json<{ choices: { message: { content: string } }[] }>().choices[0]?.message.content ?? ''
      messages.push({ role: 'assistant', content: last })
      t.ok(await caughtUp(app, sims))
    }
    const n = await Promise.all([...d, p1, p2].map(async (s, i) => (await served(s)) - (before[i] as number)))
    t.ok(n[0] === 6 || n[1] === 6, `every turn on one decoder (d1 ${n[0]}, d2 ${n[1]})`)
    t.equal((n[2] as number) + (n[3] as number), 1, 'only the first turn had a prefill leg')
    const metrics = (await get(`${url}/metrics`)).text
    t.match(metrics, /^handoff_router_decode_only_total\{reason="held"\} 5$/m, 'turns 2-6 decode-only: the decoder held all but the new turn')
    // The access log says where each went and why.
    type Routed = { mode: string; prefill?: string; decode?: string; instance?: string; alone?: string; legs?: Record<string, { reason: string; cachedTokens: number }> }
    const routes = logs.filter((l) => l.msg === 'request completed' && l.route).map((l) => l.route as Routed)
    t.equal(routes.length, 6, 'one routed access-log line per turn')
    t.match(routes[0], { mode: 'pd', prefill: /^p[12]$/, decode: /^d[12]$/ }, 'the first turn: P/D')
    const decoder = routes[0]?.decode
    t.ok(
      routes.slice(1).every((r) => r?.mode === 'single' && r.instance === decoder && r.alone === 'held' && (r.legs?.single?.cachedTokens ?? 0) > 0),
      `turns 2-6: decode-only on ${decoder}, held, with the cached tokens (${JSON.stringify(routes[5])})`,
    )
    // The last turn again, straight to one engine: the same text.
    messages.pop()
    const direct = await post(`${p1.url}/v1/chat/completions`, { model: MODEL, messages, max_tokens: 8, temperature: 0 })
    t.equal(direct.json<{ choices: { message: { content: string } }[] }>().choices[0]?.message.content, last, 'the decode-only answer is what a single engine answers')
  })
})
