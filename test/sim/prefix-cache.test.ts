import t from 'tap'
import { ManualClock } from '../../common/clock.js'
import { oracleText } from '../../sim/src/oracle.js'
import { tokenize } from '../../sim/src/tokenizer.js'
import { FakeKv } from './fake-kv.js'
import { build, MODEL } from './build.js'

const words = (seed: string, n: number): string => Array.from({ length: n }, (_, i) => `${seed}${i}`).join(' ')
const SHARED = words('shared', 60)

type App = ReturnType<typeof build>['app']

async function complete(app: App, prompt: string, extra: Record<string, unknown> = {}): Promise<{ text: string; cached: number | undefined; body: Record<string, unknown> }> {
  const r = await app.inject({ method: 'POST', url: '/v1/completions', payload: { model: MODEL, prompt, max_tokens: 5, ...extra } })
  if (r.statusCode !== 200) throw new Error(`${r.statusCode} ${r.body}`)
  const body = r.json()
  return { text: body.choices[0].text, cached: body.usage.prompt_tokens_details?.cached_tokens, body }
}

/**
 * How long `request` sleeps on the engine's ManualClock: waits for its timer, then advances a
 * millisecond at a time until it settles (bounded by `maxMs`). Simulated time, so a loaded
 * machine cannot change the answer.
 */
async function simulatedMs<T>(clock: ManualClock, request: Promise<T>, maxMs: number): Promise<{ ms: number; value: T }> {
  let settled: { value: T } | undefined
  void request.then((value) => (settled = { value }))
  const turn = (): Promise<void> => new Promise((r) => setImmediate(r))
  for (let i = 0; i < 1000 && !settled && clock.pendingTimers === 0; i++) await turn()
  let ms = 0
  while (!settled && ms < maxMs) {
    clock.advance(1)
    ms++
    for (let i = 0; i < 5 && !settled; i++) await turn()
  }
  if (!settled) throw new Error(`not settled within ${maxMs} simulated ms`)
  return { ms, value: settled.value }
}

async function metric(app: App, name: string): Promise<number> {
  const text = (await app.inject({ url: '/metrics' })).body
  const line = text.split('\n').find((l) => l.startsWith(name))
  if (!line) throw new Error(`no ${name} in /metrics`)
  return Number(line.split(' ').at(-1))
}

t.test('a shared prefix hits the cache: cached_tokens, metrics, a shorter prefill, the same text', async (t) => {
  const clock = new ManualClock()
  const { app } = build(t, { enablePromptTokensDetails: true, prefillDelayMs: 600 }, { clock })
  const a = `${SHARED} and then question one`
  const b = `${SHARED} but another question here`
  const shared = tokenize(SHARED).length
  const cold = await simulatedMs(clock, complete(app, a), 700)
  const first = cold.value
  t.equal(first.cached, 0, 'a cold prompt')
  t.equal(first.text, oracleText({ kind: 'completion', prompt: a, maxTokens: 5 }))
  t.equal(cold.ms, 600, 'a cold prefill takes the whole delay')
  const warm = await simulatedMs(clock, complete(app, b), 700)
  const second = warm.value
  const want = Math.floor(shared / 16) * 16
  t.equal(second.cached, want, `the full blocks of the shared ${shared} tokens`)
  t.equal(second.text, oracleText({ kind: 'completion', prompt: b, maxTokens: 5 }), 'cached KV gives the oracle text')
  const nb = tokenize(b).length
  t.equal(warm.ms, Math.ceil((600 * (nb - want)) / nb), `the prefill pays for the uncached share only (${nb - want} of ${nb} tokens)`)
  // The same prompt again: all but its last token could hit, capped to full blocks.
  const again = (await simulatedMs(clock, complete(app, b), 700)).value
  t.equal(again.cached, Math.floor((nb - 1) / 16) * 16)
  t.equal(again.text, second.text)

  const na = tokenize(a).length
  t.equal(await metric(app, 'vllm:prefix_cache_queries_total'), na + 2 * nb)
  t.equal(await metric(app, 'vllm:prefix_cache_hits_total'), want + (again.cached as number))
  t.equal(await metric(app, 'vllm:prompt_tokens_by_source_total{model_name="handoff/sim-1",engine="0",source="local_cache_hit"}'), want + (again.cached as number))
  t.equal(await metric(app, 'vllm:prompt_tokens_by_source_total{model_name="handoff/sim-1",engine="0",source="local_compute"}'), na + 2 * nb - want - (again.cached as number))
  t.equal(await metric(app, 'vllm:kv_cache_usage_perc'), 0, 'cached free blocks are not in use')

  // prompt_logprobs need every position computed: vLLM skips reading the cache (no query counted).
  const logprobs = (await simulatedMs(clock, complete(app, b, { prompt_logprobs: 0 }), 700)).value
  t.equal(logprobs.cached, 0)
  t.equal(await metric(app, 'vllm:prefix_cache_queries_total'), na + 2 * nb)
})

t.test('without --enable-prompt-tokens-details there is no prompt_tokens_details; without caching nothing hits', async (t) => {
  const plain = build(t)
  await complete(plain.app, SHARED)
  const hit = await complete(plain.app, SHARED)
  t.notOk('prompt_tokens_details' in (hit.body.usage as object), "vLLM's default")
  t.ok((await metric(plain.app, 'vllm:prefix_cache_hits_total')) > 0)

  const off = build(t, { enablePrefixCaching: false, enablePromptTokensDetails: true })
  await complete(off.app, SHARED)
  t.equal((await complete(off.app, SHARED)).cached, 0)
  t.equal(await metric(off.app, 'vllm:prefix_cache_hits_total'), 0)
})

t.test('a full pool evicts the least recently used blocks, a prompt tail first', async (t) => {
  // 40 tokens a prompt (one a word): 2 full blocks and a partial one, in a pool of 8.
  const { app } = build(t, { enablePromptTokensDetails: true, numGpuBlocksOverride: 8 })
  const prompt = (s: string): string => words(s, 40)
  t.equal(tokenize(prompt('a')).length, 40)
  const a = prompt('a')
  await complete(app, a)
  t.equal((await complete(app, a)).cached, 32, 'cached while the pool has room')
  // Three other prompts need more than the never-used blocks: a's tail block is the oldest free one.
  for (const other of ['b', 'c', 'd']) await complete(app, prompt(other))
  const after = await complete(app, a)
  t.equal(after.cached, 16, "a's tail was evicted first, its head is still there")
  t.equal(after.text, oracleText({ kind: 'completion', prompt: a, maxTokens: 5 }), 'and recomputed right')
})

t.test('P/D: both engines cache; D pulls only the blocks it lacks', async (t) => {
  const kv = new FakeKv({ clock: new ManualClock() })
  const agent = { kv: 'agent', agentUrl: 'http://127.0.0.1:9', numGpuBlocksOverride: 64, enablePromptTokensDetails: true }
  const p = build(t, { ...agent, role: 'prefill', engineId: 'p0' }, { kvTransport: kv.transport() })
  const d = build(t, { ...agent, role: 'decode', engineId: 'd0' }, { kvTransport: kv.transport() })
  const turn = async (prompt: string): Promise<{ text: string; pCached: number; pulled: readonly number[]; remoteBlocks: number; dCached: number }> => {
    const pr = await complete(p.app, prompt, { max_tokens: 1, kv_transfer_params: { do_remote_decode: true } })
    const params = pr.body.kv_transfer_params as { remote_block_ids: number[][] }
    const dr = await complete(d.app, prompt, { kv_transfer_params: params })
    t.equal((params as Record<string, unknown>).remote_prefill_cached_tokens, pr.cached, "P's hits travel to D, as vLLM 0.32's scheduler adds them")
    return { text: dr.text, pCached: pr.cached as number, pulled: (kv.pulls.at(-1) as { remote: { blockIds: readonly number[] } }).remote.blockIds, remoteBlocks: (params.remote_block_ids[0] as number[]).length, dCached: dr.cached as number }
  }
  const a = `${SHARED} first question`
  const one = await turn(a)
  t.equal(one.text, oracleText({ kind: 'completion', prompt: a, maxTokens: 5 }))
  t.equal(one.pulled.length, one.remoteBlocks, 'a cold decoder pulls every block')
  const b = `${SHARED} second question, longer than the first`
  const two = await turn(b)
  t.equal(two.text, oracleText({ kind: 'completion', prompt: b, maxTokens: 5 }), 'the pulled tail and the cached head give the oracle text')
  const hit = Math.floor(tokenize(SHARED).length / 16)
  t.equal(two.pCached, hit * 16, 'P found the shared blocks')
  t.equal(two.dCached, hit * 16, "D reports P's hits")
  // D's own lookup: what it cached from the first pull.
  t.equal(await metric(d.app, 'vllm:prefix_cache_hits_total'), hit * 16, 'D hit the blocks it pulled the first time')
  t.equal(two.pulled.length, two.remoteBlocks - hit, 'D pulled only the tail')
  t.equal(await metric(d.app, 'vllm:prompt_tokens_by_source_total{model_name="handoff/sim-1",engine="0",source="local_cache_hit"}'), hit * 16)
  t.match((await p.app.inject({ url: '/sim/info' })).json(), { usedBlocks: 0 }, 'every lease ended, every reference dropped')
  t.match((await d.app.inject({ url: '/sim/info' })).json(), { usedBlocks: 0 })
})

t.test("a stale pull stays in D's cache: a later prompt with the prefix decodes wrong without reading it (as on vLLM)", async (t) => {
  // Nothing checks the lease here (FakeKv reads like a stock decoder); P without prefix caching
  // reuses freed blocks at once.
  const clock = new ManualClock()
  const kv = new FakeKv({ clock, leaseMs: 5000 })
  const agent = { kv: 'agent', agentUrl: 'http://127.0.0.1:9', numGpuBlocksOverride: 64 }
  const p = build(t, { ...agent, role: 'prefill', engineId: 'p0', enablePrefixCaching: false }, { kvTransport: kv.transport(), clock })
  const d = build(t, { ...agent, role: 'decode', engineId: 'd0' }, { kvTransport: kv.transport() })
  const prefill = async (prompt: string): Promise<Record<string, unknown>> => (await complete(p.app, prompt, { max_tokens: 1, kv_transfer_params: { do_remote_decode: true } })).body.kv_transfer_params as Record<string, unknown>
  const a = `${SHARED} the first request`
  const unread = await prefill(a)
  clock.advance(6000) // the lease ends unread; P reuses the blocks for someone else
  await prefill(words('other', 80))
  const late = await complete(d.app, a, { kv_transfer_params: unread })
  t.not(late.text, oracleText({ kind: 'completion', prompt: a, maxTokens: 5 }), 'the late read decodes wrong')
  // A timely request sharing the prefix: D takes the poisoned head from its cache, pulls the tail.
  const b = `${SHARED} a second request, read in time`
  const fresh = await prefill(b)
  const timely = await complete(d.app, b, { kv_transfer_params: fresh })
  t.ok((kv.pulls.at(-1)?.remote.blockIds.length ?? 0) < ((fresh.remote_block_ids as number[][])[0] as number[]).length, 'D pulled only the tail')
  t.not(timely.text, oracleText({ kind: 'completion', prompt: b, maxTokens: 5 }), 'and decodes wrong too, though its own read was in time')
})
