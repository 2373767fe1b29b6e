import { decode } from '@msgpack/msgpack'
import t from 'tap'
import { Dealer, Subscriber } from 'zeromq'
import { chainedBlockHashes } from '../../common/block-hash.js'
import { validateSimConfig } from '../../sim/src/config.js'
import { offsetEndpoint } from '../../sim/src/kv-events.js'
import { tokenize } from '../../sim/src/tokenizer.js'
import { build, MODEL } from './build.js'

type Batch = [number, Record<string, unknown>[], number]
const words = (seed: string, n: number): string => Array.from({ length: n }, (_, i) => `${seed}${i}`).join(' ')
const EVENTS = JSON.stringify({ enable_kv_cache_events: true, endpoint: 'tcp://*:0', replay_endpoint: 'tcp://*:0', topic: 'kv@sim' })

/** Every message on `sub` until `until` holds for the batches so far (bounded by `ms`). */
async function collect(sub: Subscriber, until: (batches: { seq: bigint; batch: Batch }[]) => boolean, ms = 5000): Promise<{ topic: string; seq: bigint; batch: Batch }[]> {
  const out: { topic: string; seq: bigint; batch: Batch }[] = []
  const deadline = setTimeout(() => sub.close(), ms)
  try {
    while (!until(out)) {
      const [topic, seq, payload] = await sub.receive()
      out.push({ topic: String(topic), seq: (seq as Buffer).readBigUInt64BE(), batch: decode(payload as Buffer, { useBigInt64: true }) as Batch })
    }
  } catch {
    // Closed by the deadline: the caller's assertions say what was missing.
  } finally {
    clearTimeout(deadline)
  }
  return out
}

const events = (batches: { batch: Batch }[]): Record<string, unknown>[] => batches.flatMap((b) => b.batch[1])

t.test("KV events in vLLM 0.32's wire form: stored, removed, replayed", async (t) => {
  const { app } = build(t, { numGpuBlocksOverride: 6, kvEventsConfig: EVENTS })
  await app.ready()
  const info = (await app.inject({ url: '/sim/info' })).json()
  t.match(info.kvEvents, { endpoint: /^tcp:\/\/127\.0\.0\.1:\d+$/, replayEndpoint: /^tcp:\/\/127\.0\.0\.1:\d+$/, sequence: 0 }, '`tcp://*:0` binds a free port on --host')
  const sub = new Subscriber({ linger: 0 })
  t.teardown(() => sub.close())
  sub.connect(info.kvEvents.endpoint)
  sub.subscribe()
  // A slow joiner misses what was sent before it connected; wait until it is connected.
  await new Promise((r) => setTimeout(r, 200))

  const prompt = words('w', 40) // 40 tokens: two full blocks of 16
  const tokens = Array.from(tokenize(prompt))
  const r = await app.inject({ method: 'POST', url: '/v1/completions', payload: { model: MODEL, prompt, max_tokens: 2 } })
  t.equal(r.statusCode, 200)
  const first = await collect(sub, (b) => events(b).length >= 1)
  t.equal(first[0]?.topic, 'kv@sim')
  t.equal(first[0]?.seq, 0n)
  const [ts, evs, rank] = first[0]?.batch as Batch
  t.ok(Math.abs(ts - Date.now() / 1000) < 60, 'ts: seconds since the epoch, a float')
  t.equal(rank, 0, 'data_parallel_rank')
  t.equal(evs.length, 1, 'one BlockStored for the run of two blocks')
  const stored = evs[0] as { type: string; block_hashes: bigint[]; parent_block_hash: unknown; token_ids: number[]; block_size: number; medium: string; lora_id: unknown; lora_name: unknown; group_idx: number }
  t.match(stored, { type: 'BlockStored', parent_block_hash: null, block_size: 16, medium: 'GPU', lora_id: null, lora_name: null, group_idx: 0 })
  t.same(stored.token_ids, tokens.slice(0, 32), 'the token ids of the full blocks')
  t.equal(stored.block_hashes.length, 2)
  for (const h of stored.block_hashes) t.equal(typeof h, 'bigint', 'a 64-bit unsigned int on the wire')
  t.notOk('session_id' in stored || 'extra_keys' in stored, 'fields at their default are omitted, as msgspec does')
  // A consumer keys blocks by its own hash of token_ids: the engine's seed does not matter.
  t.equal(chainedBlockHashes(stored.token_ids, 16, 1).length, 2)

  // Three more prompts overflow the 6-block pool: cached blocks are evicted, one event each.
  for (const s of ['x', 'y', 'z']) await app.inject({ method: 'POST', url: '/v1/completions', payload: { model: MODEL, prompt: words(s, 40), max_tokens: 2 } })
  const more = await collect(sub, (b) => events(b).some((e) => e.type === 'BlockRemoved'))
  const removed = events(more).filter((e) => e.type === 'BlockRemoved')
  t.ok(removed.length >= 1)
  for (const e of removed) {
    t.match(e, { medium: 'GPU', group_idx: 0 })
    t.equal((e.block_hashes as bigint[]).length, 1, 'one hash an event, as vLLM sends them')
  }
  t.ok(removed.some((e) => (e.block_hashes as bigint[])[0] === stored.block_hashes[1]), "the first prompt's tail went first")
  t.ok(more.length > 0)

  // Replay: every buffered batch from the sequence asked for, then the end marker.
  const published = (await app.inject({ url: '/sim/info' })).json().kvEvents.sequence as number
  const dealer = new Dealer({ linger: 0 })
  t.teardown(() => dealer.close())
  dealer.connect(info.kvEvents.replayEndpoint)
  const start = Buffer.alloc(8)
  start.writeBigUInt64BE(0n)
  await dealer.send([Buffer.alloc(0), start])
  const replayed: bigint[] = []
  for (;;) {
    const [empty, topic, seq, payload] = await dealer.receive()
    t.equal(empty?.length, 0)
    if ((seq as Buffer).readBigInt64BE() === -1n) {
      t.equal(topic?.length, 0, 'the end marker: empty topic, seq -1, empty payload')
      t.equal(payload?.length, 0)
      break
    }
    replayed.push((seq as Buffer).readBigUInt64BE())
    if (replayed.length === 1) t.same(decode(payload as Buffer, { useBigInt64: true }), first[0]?.batch, 'the same bytes as published')
  }
  // Batches still flushing when the request came may follow: at least what was published before.
  t.ok(replayed.length >= published, `every batch published before the request (${published}), and any since`)
  t.same(replayed, Array.from({ length: replayed.length }, (_, i) => BigInt(i)), 'from 0, in order, no gap')
})

t.test('--kv-events-config: vLLM defaults, bad JSON and unknown fields refused, the dp port offset', async (t) => {
  t.throws(() => validateSimConfig({ kvEventsConfig: '{nope' }), { code: 'SIM_ERR_INVALID_CONFIG', message: /not JSON/ })
  t.throws(() => validateSimConfig({ kvEventsConfig: '{"enable_kv_cache_events": true, "bogus": 1}' }), { code: 'SIM_ERR_INVALID_CONFIG', message: /--kv-events-config/ })
  // Events off (vLLM's null publisher): nothing opens.
  const { app } = build(t, { kvEventsConfig: '{"enable_kv_cache_events": false}' })
  await app.ready()
  t.equal((await app.inject({ url: '/sim/info' })).json().kvEvents, null)
  t.equal(offsetEndpoint('tcp://*:5557', 0), 'tcp://*:5557')
  t.equal(offsetEndpoint('tcp://*:5557', 2), 'tcp://*:5559')
  t.equal(offsetEndpoint('tcp://*:0', 2), 'tcp://*:0')
  t.equal(offsetEndpoint('ipc:///tmp/kv', 1), 'ipc:///tmp/kv_dp1')
})
