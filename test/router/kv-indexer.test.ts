import t from 'tap'
import { request } from 'undici'
import { tokenize } from '../../sim/src/tokenizer.js'
import { get, post, startRouter, startSim, waitFor } from '../helpers/cluster.js'

/*
 * Issue 39 part 2: the router follows the KV events of every instance configured with
 * `kvEvents`, and its index follows the topology. Real simulator processes publish as vLLM
 * 0.32 does; what the router's index predicts for a prompt is compared with the
 * `cached_tokens` the prefiller then reports for it.
 */

const MODEL = 'handoff/sim-1'
const ADMIN = 'admin-token-kv-1'
const auth = { authorization: `Bearer ${ADMIN}` }
const words = (seed: string, n: number): string => Array.from({ length: n }, (_, i) => `${seed}${i}`).join(' ')
const SYSTEM = words('system', 64)
const prompt = (user: string): string => `${SYSTEM} ${words(user, 40)}`

interface SimInfo {
  kvEvents: { endpoint: string; replayEndpoint: string | null; sequence: number }
}

function blocksMetric(text: string, instance: string): number | undefined {
  const m = new RegExp(`^handoff_router_kv_index_blocks\\{instance="${instance}"\\} (\\d+)`, 'm').exec(text)
  return m ? Number(m[1]) : undefined
}

t.test('instances with kvEvents are followed while they are in the topology; the index predicts what P reports', async (t) => {
  const events = JSON.stringify({ enable_kv_cache_events: true, endpoint: 'tcp://*:0', replay_endpoint: 'tcp://*:0' })
  const p = await startSim(t, ['--role', 'prefill', '--num-gpu-blocks-override', '256', '--enable-prompt-tokens-details', '--kv-events-config', events])
  const d = await startSim(t, ['--role', 'decode'])
  const info = (await get(`${p.url}/sim/info`)).json<SimInfo>().kvEvents
  const { url, app } = await startRouter(t, [{ id: 'd0', role: 'decode', url: d.url }], { adminToken: ADMIN, probe: false })
  const added = await post(`${url}/admin/instances`, { id: 'p0', role: 'prefill', url: p.url, kvEvents: { endpoint: info.endpoint, replayEndpoint: info.replayEndpoint } }, auth)
  t.equal(added.status, 201, added.text)
  t.same(app.kv.following, ['p0'], 'the instance with kvEvents is followed, the other not')
  // ZMQ subscribes asynchronously; a batch sent before would show only as a gap at the next.
  await new Promise((r) => setTimeout(r, 200))
  const users = ['alice', 'bob', 'carol'].map(prompt)
  for (const u of users) t.equal((await post(`${url}/v1/completions`, { model: MODEL, prompt: u, max_tokens: 2 })).status, 200)
  const published = async (): Promise<number> => (await get(`${p.url}/sim/info`)).json<SimInfo>().kvEvents.sequence
  const caughtUp = async (): Promise<boolean> => {
    const feed = await app.kv.feed('p0')
    return feed?.sequence === BigInt((await published()) - 1)
  }
  t.ok(await waitFor(caughtUp), 'the router applied every batch P published')
  // Asked of P directly: what P reports cached is what the router's index predicted.
  for (const u of [users[1] as string, prompt('dave'), users[0] as string]) {
    const predicted = app.kv.index.cachedTokens('p0', app.kv.index.prompt(tokenize(u)))
    const r = await post(`${p.url}/v1/completions`, { model: MODEL, prompt: u, max_tokens: 1, kv_transfer_params: { do_remote_decode: true } })
    const reported = r.json<{ usage: { prompt_tokens_details: { cached_tokens: number } } }>().usage.prompt_tokens_details.cached_tokens
    t.equal(predicted, reported, `predicted ${predicted}, reported ${reported}`)
    t.ok(await waitFor(caughtUp))
  }
  const metrics = (await get(`${url}/metrics`)).text
  const blocks = blocksMetric(metrics, 'p0')
  t.ok(blocks !== undefined && blocks === app.kv.index.blocks('p0') && blocks > 0, `handoff_router_kv_index_blocks{instance="p0"} ${blocks}`)
  t.match(metrics, /^handoff_router_kv_event_batches_total\{instance="p0"\} [1-9]/m)

  // A new engine_id answering for the instance: the engine restarted, its cache is empty.
  const engineId = app.topology.describe('p0')?.engineId as string
  t.ok(engineId, `P's engine_id learnt from its answers (${engineId})`)
  app.topology.observeEngineId('p0', `${engineId}-restarted`)
  t.equal(app.kv.index.blocks('p0'), 0, 'a new engine_id purges the instance\'s index')
  t.match((await get(`${url}/metrics`)).text, /^handoff_router_kv_index_purges_total\{reason="engine_id"\} 1/m)
  // (Blocks that extend a purged one stay unindexed: the router cannot tell which prefix they
  // continue. A prompt of its own, from the first block, is indexed again.)
  await post(`${p.url}/v1/completions`, { model: MODEL, prompt: words('fresh', 100), max_tokens: 1, kv_transfer_params: { do_remote_decode: true } })
  t.ok(await waitFor(async () => app.kv.index.blocks('p0') > 0), 'and the feed goes on filling it')

  const removed = await request(`${url}/admin/instances/p0`, { method: 'DELETE', headers: auth })
  await removed.body.dump()
  t.equal(removed.statusCode, 200)
  t.same(app.kv.following, [], 'removed: no longer followed')
  t.equal(app.kv.index.blocks('p0'), 0, 'and its blocks are gone')
  t.equal(blocksMetric((await get(`${url}/metrics`)).text, 'p0'), undefined, 'and its series')
  t.match((await get(`${url}/metrics`)).text, /^handoff_router_kv_index_purges_total\{reason="removed"\} 1/m)
})

t.test('the per-engine bound drops the oldest blocks and counts them; blocks past a dropped parent are counted unindexed', async (t) => {
  const events = JSON.stringify({ enable_kv_cache_events: true, endpoint: 'tcp://*:0', replay_endpoint: 'tcp://*:0' })
  const p = await startSim(t, ['--role', 'prefill', '--num-gpu-blocks-override', '256', '--kv-events-config', events])
  const info = (await get(`${p.url}/sim/info`)).json<SimInfo>().kvEvents
  const { app, url } = await startRouter(t, [{ id: 'p0', role: 'prefill', url: p.url, kvEvents: { endpoint: info.endpoint, replayEndpoint: info.replayEndpoint ?? undefined } }], {
    probe: false,
    kvIndex: { maxBlocksPerEngine: 4 },
  })
  await new Promise((r) => setTimeout(r, 200))
  const long = words('long', 200)
  await post(`${p.url}/v1/completions`, { model: MODEL, prompt: long, max_tokens: 1, kv_transfer_params: { do_remote_decode: true } })
  t.ok(await waitFor(async () => /^handoff_router_kv_index_evicted_blocks_total [1-9]/m.test((await get(`${url}/metrics`)).text)), 'evictions are counted')
  t.ok(app.kv.index.blocks('p0') <= 4, `and the index holds at most the bound (${app.kv.index.blocks('p0')})`)
  // Another prompt pushes every block of the first out of the index (not out of P's cache); the
  // first prompt and more then extends a parent the index no longer holds.
  await post(`${p.url}/v1/completions`, { model: MODEL, prompt: words('other', 200), max_tokens: 1, kv_transfer_params: { do_remote_decode: true } })
  await post(`${p.url}/v1/completions`, { model: MODEL, prompt: `${long} ${words('more', 100)}`, max_tokens: 1, kv_transfer_params: { do_remote_decode: true } })
  t.ok(await waitFor(async () => /^handoff_router_kv_index_unindexed_blocks_total [1-9]/m.test((await get(`${url}/metrics`)).text)), 'the blocks past a dropped parent are counted unindexed')
})
