import t from 'tap'
import { chainedBlockHashes } from '../../common/block-hash.js'
import { BlockPool, type BlockEvent } from '../../sim/src/block-pool.js'

const BS = 4

function pool(numBlocks: number, enableCaching = true): { pool: BlockPool; events: BlockEvent[] } {
  const events: BlockEvent[] = []
  return { pool: new BlockPool({ numBlocks, blockSize: BS, enableCaching, hashSeed: 7, onEvent: (e) => events.push(e) }), events }
}

const seq = (from: number, n: number): number[] => Array.from({ length: n }, (_, i) => from + i)

t.test('without caching: LIFO reuse, as the allocator it replaced', async (t) => {
  const { pool: p, events } = pool(8, false)
  const first = p.allocate(3)
  t.same(first, [0, 1, 2])
  t.same(p.allocate(2), [3, 4])
  p.cache(first, chainedBlockHashes(seq(0, 12), BS, 1), seq(0, 12))
  p.free(first)
  t.equal(p.usedCount, 2)
  t.equal(p.cachedCount, 0, 'nothing is cached')
  t.same(p.allocate(3), [0, 1, 2], 'the freed blocks come back first, in the same order')
  t.throws(() => p.free([7]), /freed twice/)
  t.throws(() => p.free([99]), RangeError)
  t.throws(() => p.allocate(4), { code: 'SIM_ERR_KV_CAPACITY', statusCode: 503 })
  t.equal(p.freeCount, 3, 'a failed allocation takes nothing')
  t.same(events, [], 'no KV events')
})

t.test('a shared prefix hits the cached blocks, capped and all or nothing', async (t) => {
  const { pool: p, events } = pool(8)
  const a = seq(100, 10) // 2 full blocks + 2 tokens
  const ha = chainedBlockHashes(a, BS, 7)
  t.equal(ha.length, 2)
  const first = p.acquire(ha, 3)
  t.same(first, { blocks: [0, 1, 2], hit: 0 })
  p.cache(first.blocks, ha, a)
  t.same(events, [{ type: 'BlockStored', blockHashes: ha, parentBlockHash: null, tokenIds: a.slice(0, 8), blockSize: BS }])
  // A second prompt sharing the first block only, while the first is still running.
  const b = [...a.slice(0, 4), 1, 2, 3, 4, 5]
  const hb = chainedBlockHashes(b, BS, 7)
  t.equal(hb[0], ha[0])
  t.not(hb[1], ha[1])
  const second = p.acquire(hb, 3)
  t.same(second, { blocks: [0, 3, 4], hit: 1 }, 'block 0 is shared, referenced twice')
  p.free(first.blocks)
  t.equal(p.usedCount, 3, 'block 0 is still referenced by the second')
  p.free(second.blocks)
  t.equal(p.usedCount, 0)
  t.equal(p.freeCount, 8)
  // A full match is capped by maxHit (vLLM recomputes the last token: num_tokens − 1).
  const again = p.acquire(ha, 3, 1)
  t.equal(again.hit, 1)
  t.equal(again.blocks[0], 0)
  p.free(again.blocks)
  t.same(p.match(ha), [0, 1], 'both blocks are still cached while free')
  // Not enough room: nothing is taken, hits included.
  t.throws(() => p.acquire(ha, 11), { code: 'SIM_ERR_KV_CAPACITY' })
  t.equal(p.freeCount, 8)
  t.same(p.match(ha), [0, 1])
})

t.test('free cached blocks are evicted least recently used, a request tail first', async (t) => {
  const { pool: p, events } = pool(4)
  const a = seq(0, 8)
  const ha = chainedBlockHashes(a, BS, 1)
  const ga = p.acquire(ha, 2)
  p.cache(ga.blocks, ha, a)
  p.free(ga.blocks)
  const b = seq(50, 8)
  const hb = chainedBlockHashes(b, BS, 1)
  const gb = p.acquire(hb, 2)
  t.same(gb.blocks, [2, 3], 'fresh blocks come before cached ones')
  p.cache(gb.blocks, hb, b)
  p.free(gb.blocks)
  events.length = 0
  // One more block: the least recently freed request's tail goes first.
  t.same(p.allocate(1), [1])
  t.same(events, [{ type: 'BlockRemoved', blockHashes: [ha[1]] }])
  t.same(p.match(ha), [0], 'the head of A is still cached')
  // A hit on B moves it to the back of the queue when freed again: A's head goes next.
  const hit = p.acquire(hb, 2)
  t.equal(hit.hit, 2)
  p.free(hit.blocks)
  events.length = 0
  t.same(p.allocate(1), [0])
  t.same(events, [{ type: 'BlockRemoved', blockHashes: [ha[0]] }])
  t.same(p.match(hb), [2, 3])
})

t.test('uncached blocks are reused before cached ones, and cache() skips held hashes', async (t) => {
  const { pool: p, events } = pool(6)
  const a = seq(0, 6) // one full block + a partial one
  const ha = chainedBlockHashes(a, BS, 1)
  const ga = p.acquire(ha, 2)
  p.cache(ga.blocks, ha, a)
  p.free(ga.blocks)
  // The partial block (1) was freed uncached: it is handed out first.
  t.same(p.allocate(1), [1])
  // A second copy of a held hash: the copy stays uncached, no event.
  const copy = p.allocate(1)
  events.length = 0
  p.cache(copy, ha, a)
  t.same(events, [])
  t.same(p.match(ha), [0])
  // A BlockStored per run: blocks after the hit chain from their parent.
  const b = seq(0, 12)
  const hb = chainedBlockHashes(b, BS, 1)
  const gb = p.acquire(hb, 3)
  t.equal(gb.hit, 1)
  p.cache(gb.blocks, hb, b, gb.hit)
  t.same(events, [{ type: 'BlockStored', blockHashes: hb.slice(1), parentBlockHash: hb[0], tokenIds: b.slice(4, 12), blockSize: BS }])
  events.length = 0
  p.reset()
  t.same(events, [{ type: 'AllBlocksCleared' }])
  t.equal(p.cachedCount, 0)
  t.same(p.match(hb), [])
})

t.test('chained block hashes', async (t) => {
  const tokens = seq(1, 40)
  const h = chainedBlockHashes(tokens, 16, 3)
  t.equal(h.length, 2, 'full blocks only')
  t.same(chainedBlockHashes(tokens, 16, 3, h[0], 1), [h[1]], 'a chain continues from its parent')
  t.not(chainedBlockHashes(tokens, 16, 4)[0], h[0], 'the seed changes every hash')
  const moved = [...tokens]
  moved[20] = 999
  const h2 = chainedBlockHashes(moved, 16, 3)
  t.equal(h2[0], h[0])
  t.not(h2[1], h[1])
  // Swapping two tokens within a block changes its hash (the offset is mixed in).
  const swapped = [...tokens]
  ;[swapped[0], swapped[1]] = [swapped[1] as number, swapped[0] as number]
  t.not(chainedBlockHashes(swapped, 16, 3)[0], h[0])
  for (const x of h) t.ok(x >= 0n && x < 1n << 64n, 'an unsigned 64-bit int')
  t.throws(() => chainedBlockHashes(tokens, 0, 3), RangeError)
})
