import { encode } from '@msgpack/msgpack'
import t from 'tap'
import { Subscriber } from 'zeromq'
import { decodeKvBatch, KvEventsWireError, readSequence, type KvEvent } from '../../router/src/routing/kv-events-wire.js'
import { PrefixIndex } from '../../router/src/routing/prefix-index.js'
import { tokenize } from '../../sim/src/tokenizer.js'
import { build, MODEL } from '../sim/build.js'

/*
 * Issue 39 part 2: the router's index of each engine's prefix cache, from the engines' KV
 * events. The last case holds it to the simulator's real cache: what the index says an engine
 * holds for a prompt must be the `cached_tokens` that engine then reports.
 */

const SEED = 0x5eed
const words = (seed: string, n: number): string => Array.from({ length: n }, (_, i) => `${seed}${i}`).join(' ')
const seq = (from: number, n: number): number[] => Array.from({ length: n }, (_, i) => from + i)
const index = (maxBlocksPerEngine = 1000, maxEngines = 10): PrefixIndex => new PrefixIndex({ seed: SEED, maxBlocksPerEngine, maxEngines })
const stored = (hashes: (bigint | number)[], parent: bigint | number | null, tokens: number[], blockSize = 4): Record<string, unknown> => ({
  type: 'BlockStored',
  block_hashes: hashes,
  parent_block_hash: parent,
  token_ids: tokens,
  block_size: blockSize,
  lora_id: null,
  medium: 'GPU',
  lora_name: null,
  group_idx: 0,
})
const batch = (events: unknown[]): Uint8Array => encode([1_765_000_000.5, events, 0], { useBigInt64: true })

t.test('the wire: tagged maps and the positional form read alike; hashes as keys', async (t) => {
  const big = 2n ** 63n + 5n
  const tagged = decodeKvBatch(batch([stored([big, 7], null, seq(0, 8)), { type: 'BlockRemoved', block_hashes: [7], medium: 'GPU' }, { type: 'AllBlocksCleared' }]))
  // Before 0.32: [tag, block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium].
  const positional = decodeKvBatch(batch([['BlockStored', [big, 7], null, seq(0, 8), 4, null, 'GPU'], ['BlockRemoved', [7], 'GPU'], ['AllBlocksCleared']]))
  t.same(tagged, positional, 'the same events either way')
  t.equal(tagged.ts, 1_765_000_000.5)
  t.equal(tagged.dataParallelRank, 0)
  const first = tagged.events[0] as Extract<KvEvent, { type: 'BlockStored' }>
  t.same(first.blockHashes, [big.toString(), '7'], 'a 64-bit hash and a small one are both decimal keys')
  t.ok(first.tokensOnly)
  const keyedBy = (extra: Record<string, unknown>): boolean => (decodeKvBatch(batch([{ ...stored([1], null, seq(0, 4)), ...extra }])).events[0] as Extract<KvEvent, { type: 'BlockStored' }>).tokensOnly
  t.notOk(keyedBy({ lora_name: 'sql-adapter' }), 'a LoRA block is not the same tokens without it')
  t.notOk(keyedBy({ extra_keys: [['salt-1']] }), 'nor a salted or multimodal one')
  t.ok(keyedBy({ extra_keys: [null] }), 'no extra key on the block')
  t.notOk((decodeKvBatch(batch([['BlockStored', [1], null, seq(0, 4), 4, 3, 'GPU']])).events[0] as Extract<KvEvent, { type: 'BlockStored' }>).tokensOnly, 'the older lora_id')
  t.same(decodeKvBatch(batch([{ type: 'BlockRemoved', block_hashes: [Buffer.from([0xab, 0x01])] }])).events, [{ type: 'BlockRemoved', blockHashes: ['xab01'], medium: null, groupIdx: 0 }], 'bytes hashes (int hashes off) as hex')
  t.same(decodeKvBatch(batch([{ type: 'SomethingNewer', x: 1 }, ['AlsoNew']])).events, [], 'unknown event types are skipped')
  t.throws(() => decodeKvBatch(Buffer.from([0xc1])), KvEventsWireError, 'not msgpack')
  t.throws(() => decodeKvBatch(encode({ a: 1 })), KvEventsWireError, 'not a batch')
  t.throws(() => decodeKvBatch(batch([stored([1], null, seq(0, 4), 0)])), KvEventsWireError, 'block_size 0')
  t.throws(() => decodeKvBatch(batch([{ ...stored([1], null, seq(0, 4)), block_hashes: [1.5] }])), KvEventsWireError, 'a hash that is not an int')
  const frame = Buffer.alloc(8)
  frame.writeBigInt64BE(-1n)
  t.equal(readSequence(frame), -1n, "the replay's end marker")
  frame.writeBigInt64BE(41n)
  t.equal(readSequence(frame), 41n)
  t.throws(() => readSequence(Buffer.alloc(4)), KvEventsWireError)
})

t.test('the index: chained runs, removal, clear, purge, and what an engine may not use', async (t) => {
  const ix = index()
  const prompt = ix.prompt(seq(100, 13)) // three full blocks of 4, one token over
  // Two runs: blocks 0-1 first, then block 2 chained from block 1's engine hash.
  let a = ix.apply('p', decodeKvBatch(batch([stored([11, 12], null, seq(100, 8))])).events)
  t.same(a, { stored: 2, removed: 0, orphaned: 0, keyed: 0, evicted: 0, cleared: false })
  t.equal(ix.cachedTokens('p', prompt), 8)
  ix.apply('p', decodeKvBatch(batch([stored([13], 12, seq(108, 4))])).events)
  t.equal(ix.cachedTokens('p', prompt), 12, 'the second run continues the first: the whole 12-token prefix')
  t.equal(ix.cachedTokens('p', ix.prompt(seq(100, 12))), 8, 'a 12-token prompt can use 8: the last token is always computed')
  t.equal(ix.cachedTokens('p', ix.prompt([...seq(100, 4), 999, ...seq(105, 8)])), 4, 'a prompt that differs in block 1 shares block 0 alone')
  t.equal(ix.cachedTokens('d', prompt), 0, 'an engine without events holds nothing')

  a = ix.apply('p', decodeKvBatch(batch([stored([99], 55, seq(0, 4))])).events)
  t.equal(a.orphaned, 1, 'a run whose parent is unknown is not indexed')
  a = ix.apply('p', decodeKvBatch(batch([{ ...stored([31], null, seq(500, 4)), extra_keys: [['salt']] }, stored([32], 31, seq(504, 4))])).events)
  t.same([a.keyed, a.orphaned, a.stored], [1, 1, 0], 'a salted run is not indexed, nor what extends it')
  t.equal(ix.cachedTokens('p', ix.prompt(seq(500, 9))), 0)
  a = ix.apply('p', decodeKvBatch(batch([{ type: 'BlockRemoved', block_hashes: [12, 404], medium: 'GPU' }])).events)
  t.equal(a.removed, 1, 'an unknown hash removes nothing')
  t.equal(ix.cachedTokens('p', prompt), 4, 'a removed middle block ends the prefix there')
  ix.apply('p', decodeKvBatch(batch([stored([12], 11, seq(104, 4))])).events)
  t.equal(ix.cachedTokens('p', prompt), 12, 'stored again')

  ix.apply('p', decodeKvBatch(batch([{ ...stored([21], null, seq(100, 4)), medium: 'CPU' }, { ...stored([22], null, seq(100, 4)), group_idx: 1 }])).events)
  t.equal(ix.blocks('p'), 3, 'an offloaded tier and another KV group are not indexed')
  a = ix.apply('p', decodeKvBatch(batch([{ type: 'AllBlocksCleared' }])).events)
  t.ok(a.cleared)
  t.equal(ix.cachedTokens('p', prompt), 0, 'AllBlocksCleared empties it')
  ix.apply('p', decodeKvBatch(batch([stored([11], null, seq(100, 4))])).events)
  t.ok(ix.purge('p'))
  t.equal(ix.cachedTokens('p', prompt), 0, 'purged')
  t.notOk(ix.purge('p'))
})

t.test('the index is bounded: blocks per engine, and engines', async (t) => {
  const ix = index(4, 2)
  // Six one-block prompts: the oldest two go.
  for (let i = 0; i < 6; i++) {
    const a = ix.apply('p', decodeKvBatch(batch([stored([i + 1], null, seq(i * 10, 4))])).events)
    t.equal(a.evicted, i < 4 ? 0 : 1)
  }
  t.equal(ix.blocks('p'), 4)
  t.equal(ix.cachedTokens('p', ix.prompt(seq(0, 5))), 0, 'the oldest was evicted')
  t.equal(ix.cachedTokens('p', ix.prompt(seq(50, 5))), 4, 'the newest is held')
  ix.apply('d1', decodeKvBatch(batch([stored([1], null, seq(0, 4))])).events)
  ix.apply('d2', decodeKvBatch(batch([stored([1], null, seq(0, 4))])).events)
  t.same(ix.engines(), ['d1', 'd2'], 'the least recently updated engine went first')
  t.throws(() => new PrefixIndex({ seed: 1, maxBlocksPerEngine: 0, maxEngines: 1 }), RangeError)
})

t.test("the simulator's own events: the index predicts the cached_tokens it then reports", async (t) => {
  const config = { numGpuBlocksOverride: 12, enablePromptTokensDetails: true, kvEventsConfig: JSON.stringify({ enable_kv_cache_events: true, endpoint: 'tcp://*:0' }) }
  const { app } = build(t, config)
  await app.ready()
  const info = (await app.inject({ url: '/sim/info' })).json<{ kvEvents: { endpoint: string } }>()
  const sub = new Subscriber({ linger: 0, receiveTimeout: 5000 })
  t.teardown(() => sub.close())
  sub.connect(info.kvEvents.endpoint)
  sub.subscribe()
  await new Promise((r) => setTimeout(r, 200)) // a slow joiner misses what is sent before it connects
  const ix = index(1000, 4)
  let last = -1n
  let sequenceGaps = 0
  /** Applies every batch the engine published for one request (its events go out in the request's turn). */
  let next: Promise<Buffer[]> | undefined
  const drain = async (): Promise<void> => {
    for (;;) {
      // A receive that lost the race to the quiet timer is kept for the next round, not dropped.
      next ??= sub.receive()
      const frames = await Promise.race([next, new Promise<undefined>((r) => setTimeout(() => r(undefined), 150))])
      if (frames === undefined) return
      next = undefined
      const s = readSequence(frames[1] as Buffer)
      if (s !== last + 1n) sequenceGaps++
      last = s
      ix.apply('sim', decodeKvBatch(frames[2] as Buffer).events)
    }
  }
  const complete = async (prompt: string): Promise<number> => {
    const r = await app.inject({ method: 'POST', url: '/v1/completions', payload: { model: MODEL, prompt, max_tokens: 2 } })
    t.equal(r.statusCode, 200)
    return r.json<{ usage: { prompt_tokens_details: { cached_tokens: number } } }>().usage.prompt_tokens_details.cached_tokens
  }
  // 12 blocks of 16: a shared 64-token system prompt, then users' questions that evict each other.
  const system = words('system', 64)
  const prompts = [...Array.from({ length: 6 }, (_, u) => `${system} ${words(`user${u}q`, 40)}`), `${system} ${words('user5q', 40)}`, `${system} ${words('user0q', 40)}`, words('cold', 30)]
  let compared = 0
  const hits: number[] = []
  for (const prompt of prompts) {
    const predicted = ix.cachedTokens('sim', ix.prompt(tokenize(prompt)))
    const reported = await complete(prompt)
    t.equal(predicted, reported, `predicted ${predicted}, the engine reported ${reported} cached tokens`)
    compared++
    hits.push(reported)
    await drain()
  }
  t.equal(compared, prompts.length)
  t.ok(hits.some((h) => h > 64), `a whole prompt hit once (${hits.join(', ')})`)
  t.equal(sequenceGaps, 0, 'no batch missed')
  t.ok(ix.blocks('sim') > 0 && ix.blocks('sim') <= 12, `the index holds what the 12-block pool holds (${ix.blocks('sim')})`)
})
