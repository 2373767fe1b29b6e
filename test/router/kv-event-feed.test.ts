import { pino } from 'pino'
import t from 'tap'
import { Publisher, Subscriber } from 'zeromq'
import { KvEventFeed } from '../../router/src/routing/kv-event-feed.js'
import { PrefixIndex } from '../../router/src/routing/prefix-index.js'
import { tokenize } from '../../sim/src/tokenizer.js'
import { get, post, startSim, type Teardown } from '../helpers/cluster.js'
import { within } from '../helpers/pd-agents.js'
import { freePort } from '../../common/ports.js'

/*
 * Issue 39 part 2: one engine's KV events into the router's prefix index, against a real
 * simulator process publishing as vLLM 0.32 does (PUB + replay ROUTER). What the index
 * predicts an engine holds for a prompt is compared with the `cached_tokens` the engine then
 * reports: equal while the feed is whole; after a loss it must never claim more than the
 * engine has (a false hit sends a prompt where its KV is not).
 */

const MODEL = 'handoff/sim-1'
const words = (seed: string, n: number): string => Array.from({ length: n }, (_, i) => `${seed}${i}`).join(' ')
const SYSTEM = words('system', 64)
const log = pino({ level: 'silent' })

interface Info {
  kvEvents: { endpoint: string; replayEndpoint: string | null; sequence: number }
}

async function engine(t: Teardown, blocks: number, events: Record<string, unknown>): Promise<{ url: string; info: Info['kvEvents']; stop: () => Promise<unknown> }> {
  const config = JSON.stringify({ enable_kv_cache_events: true, endpoint: 'tcp://*:0', replay_endpoint: 'tcp://*:0', ...events })
  const sim = await startSim(t, ['--role', 'both', '--num-gpu-blocks-override', String(blocks), '--enable-prompt-tokens-details', '--kv-events-config', config])
  const info = (await get(`${sim.url}/sim/info`)).json<Info>().kvEvents
  return { url: sim.url, info, stop: () => sim.stop() }
}

async function cachedTokens(url: string, prompt: string): Promise<number> {
  const r = await post(`${url}/v1/completions`, { model: MODEL, prompt, max_tokens: 2 })
  if (r.status !== 200) throw new Error(`${r.status} ${r.text}`)
  return r.json<{ usage: { prompt_tokens_details: { cached_tokens: number } } }>().usage.prompt_tokens_details.cached_tokens
}

/** Waits until the feed has applied everything the engine published (bounded). */
async function caughtUp(url: string, feed: KvEventFeed, ms = 5000): Promise<boolean> {
  const applied = async (): Promise<boolean> => {
    const published = (await get(`${url}/sim/info`)).json<Info>().kvEvents.sequence
    return published === 0 || feed.sequence === BigInt(published - 1)
  }
  return (await within(ms, applied)) >= 0
}

/**
 * A lossy link between the engine's PUB socket and the feed: forwards every batch, except
 * while `dropping` (what a subscriber past its high-water mark, or a reconnect, loses). The
 * replay socket stays direct.
 */
async function lossyLink(t: Teardown, endpoint: string): Promise<{ endpoint: string; dropping: boolean; dropped: number }> {
  const sub = new Subscriber({ linger: 0 })
  const pub = new Publisher({ linger: 0 })
  t.teardown(() => {
    sub.close()
    pub.close()
  })
  sub.connect(endpoint)
  sub.subscribe()
  await pub.bind('tcp://127.0.0.1:*')
  const link = { endpoint: pub.lastEndpoint as string, dropping: false, dropped: 0 }
  void (async () => {
    try {
      for await (const frames of sub) {
        if (link.dropping) link.dropped++
        else await pub.send(frames)
      }
    } catch {
      // closed at teardown
    }
  })()
  return link
}

function open(t: Teardown, index: PrefixIndex, info: Info['kvEvents'], extra: Partial<Parameters<typeof KvEventFeed.open>[0]> = {}): Promise<KvEventFeed> {
  return KvEventFeed.open({ key: 'e', endpoint: info.endpoint, replayEndpoint: info.replayEndpoint ?? undefined, index, log, replayTimeoutMs: 2000, ...extra }).then((f) => {
    t.teardown(() => f.close())
    return f
  })
}

const index = (): PrefixIndex => new PrefixIndex({ seed: 7, maxBlocksPerEngine: 10_000, maxEngines: 8 })
const users = (tag: string, n: number): string[] => Array.from({ length: n }, (_, u) => `${SYSTEM} ${words(`${tag}${u}q`, 40)}`)

t.test('joining late: the replay of the buffer tells the feed what the engine already holds', async (t) => {
  const e = await engine(t, 64, {})
  const warm = users('early', 3)
  for (const p of warm) await cachedTokens(e.url, p)
  const ix = index()
  const feed = await open(t, ix, e.info)
  t.ok(await caughtUp(e.url, feed), 'the feed caught up through the replay')
  t.ok(feed.stats.replays >= 1 && feed.stats.gaps === 0 && feed.stats.purges === 0, JSON.stringify(feed.stats))
  for (const p of [warm[2] as string, warm[0] as string, ...users('late', 3)]) {
    const predicted = ix.cachedTokens('e', ix.prompt(tokenize(p)))
    const reported = await cachedTokens(e.url, p)
    t.equal(predicted, reported, `predicted ${predicted}, reported ${reported}`)
    t.ok(await caughtUp(e.url, feed))
  }
  t.ok(ix.cachedTokens('e', ix.prompt(tokenize(warm[0] as string))) > 64, 'a whole prompt sent before the feed joined is known')
})

t.test('a gap (batches lost on the way) is filled by replay', async (t) => {
  // 24 blocks: 12 users of 7 blocks each evict each other, so the lost batches hold BlockRemoved.
  const e = await engine(t, 24, {})
  const link = await lossyLink(t, e.info.endpoint)
  const ix = index()
  const feed = await open(t, ix, { ...e.info, endpoint: link.endpoint })
  await new Promise((r) => setTimeout(r, 200)) // the link's and the feed's subscriptions settle
  for (const p of users('before', 2)) await cachedTokens(e.url, p)
  t.ok(await caughtUp(e.url, feed))
  link.dropping = true
  for (const p of users('lost', 6)) await cachedTokens(e.url, p)
  link.dropping = false
  t.ok(link.dropped > 0, `the link lost ${link.dropped} batches`)
  t.equal(ix.cachedTokens('e', ix.prompt(tokenize(users('before', 2)[0] as string))) > 64, true, 'the index still holds what the lost batches removed')
  for (const p of users('after', 2)) await cachedTokens(e.url, p)
  t.ok(await caughtUp(e.url, feed), 'caught up')
  t.comment(`feed: ${JSON.stringify(feed.stats)}`)
  t.equal(feed.stats.gaps, 1, 'the next batch showed the gap')
  t.equal(feed.stats.purges, 0, 'the replay filled it')
  for (const p of [...users('after', 2).reverse(), ...users('lost', 6).reverse(), ...users('before', 2)]) {
    const predicted = ix.cachedTokens('e', ix.prompt(tokenize(p)))
    const reported = await cachedTokens(e.url, p)
    t.equal(predicted, reported, `predicted ${predicted}, reported ${reported}`)
    t.ok(await caughtUp(e.url, feed))
  }
})

t.test('a gap the replay buffer no longer holds: the index is purged, never claims what is gone', async (t) => {
  // 16 blocks: each user's own blocks are evicted within three users.
  const e = await engine(t, 16, { buffer_steps: 2 })
  const link = await lossyLink(t, e.info.endpoint)
  const ix = index()
  const feed = await open(t, ix, { ...e.info, endpoint: link.endpoint })
  await new Promise((r) => setTimeout(r, 200))
  for (const p of users('before', 2)) await cachedTokens(e.url, p)
  t.ok(await caughtUp(e.url, feed))
  link.dropping = true
  for (const p of users('lost', 10)) await cachedTokens(e.url, p)
  link.dropping = false
  for (const p of users('after', 1)) await cachedTokens(e.url, p)
  t.ok(await caughtUp(e.url, feed), 'caught up')
  t.comment(`feed: ${JSON.stringify(feed.stats)}, the link lost ${link.dropped}`)
  t.equal(feed.stats.gaps, 1)
  t.equal(feed.stats.purges, 1, 'the publisher kept 2 batches: the gap could not be filled, the index was purged')
  let over = 0
  let equal = 0
  // The 'before' users first: the lost batches removed their blocks, which the index would still hold.
  const all = [...users('before', 2), ...users('lost', 10).reverse(), ...users('after', 1)]
  for (const p of all) {
    const predicted = ix.cachedTokens('e', ix.prompt(tokenize(p)))
    const reported = await cachedTokens(e.url, p)
    if (predicted > reported) over++
    if (predicted === reported) equal++
    t.ok(await caughtUp(e.url, feed))
  }
  t.comment(`after the purge: ${equal} of ${all.length} predictions exact, ${over} above`)
  t.equal(over, 0, 'no prediction above what the engine had')
  // Without the purge the index would still hold the 'before' users' blocks, evicted since.
  t.equal(ix.cachedTokens('e', ix.prompt(tokenize(`${words('system', 64)} ${words('nobody', 40)}`))) <= 64, true)
})

t.test('the engine restarts at the same endpoints: its sequence starts over, the index is purged and follows the new one', async (t) => {
  const [pubPort, replayPort] = [await freePort(), await freePort()]
  // A wildcard is bound (vLLM's rule; a plain address is connected to).
  const events = { endpoint: `tcp://*:${pubPort}`, replay_endpoint: `tcp://*:${replayPort}` }
  const first = await engine(t, 64, events)
  const ix = index()
  const feed = await open(t, ix, first.info)
  // ZMQ subscribes asynchronously: batches published before it took hold would be seen only at
  // the next one (a gap, replayed).
  await new Promise((r) => setTimeout(r, 200))
  const before = users('before', 3)
  for (const p of before) await cachedTokens(first.url, p)
  t.ok(await caughtUp(first.url, feed), 'the feed follows the first engine')
  const held = feed.sequence as bigint
  t.ok(held > 0n && ix.cachedTokens('e', ix.prompt(tokenize(before[0] as string))) > 64, `the first engine's blocks are indexed (sequence ${held})`)
  await first.stop()
  // The same endpoints, an empty cache, and sequences from 0 again (vLLM's publisher counts from 0).
  const second = await engine(t, 64, events)
  const after = users('after', 2)
  // The first batch may go out before the feed's socket reconnected, and be lost; the next
  // one shows the restart, and the replay brings the lost one.
  await cachedTokens(second.url, after[0] as string)
  await new Promise((r) => setTimeout(r, 300))
  await cachedTokens(second.url, after[1] as string)
  t.ok(await caughtUp(second.url, feed), 'the feed follows the restarted engine')
  t.equal(feed.stats.restarts, 1, 'one restart seen')
  for (const p of [before[0] as string, after[1] as string, after[0] as string]) {
    const predicted = ix.cachedTokens('e', ix.prompt(tokenize(p)))
    const reported = await cachedTokens(second.url, p)
    t.equal(predicted, reported, `predicted ${predicted}, reported ${reported}`)
    t.ok(await caughtUp(second.url, feed))
  }
})
