import { chainedBlockHashes } from '../../common/block-hash.js'
import { SIM_ERR_KV_CAPACITY } from './errors.js'

/** What the pool tells KV-event subscribers (vLLM's BlockStored, BlockRemoved, AllBlocksCleared). */
export type BlockEvent =
  | { type: 'BlockStored'; blockHashes: bigint[]; parentBlockHash: bigint | null; tokenIds: number[]; blockSize: number }
  | { type: 'BlockRemoved'; blockHashes: bigint[] }
  | { type: 'AllBlocksCleared' }

export interface BlockPoolOptions {
  numBlocks: number
  blockSize: number
  /** vLLM's --enable-prefix-caching (its default): full blocks keep their hash after free. */
  enableCaching: boolean
  /**
   * Starts every hash chain, as vLLM's NONE_HASH (random per process unless PYTHONHASHSEED
   * is set): two engines' hashes agree only by chance, so nothing may rely on them agreeing.
   */
  hashSeed: number
  onEvent?: (event: BlockEvent) => void
}

const NONE = -1

/**
 * KV blocks with reference counts and a prefix cache, as vLLM's BlockPool (v1/core/block_pool.py):
 *
 * - Free blocks wait in one queue; allocation takes the front. A freed block without a hash
 *   goes to the front in the order freed, so the next allocation of the same size gets the
 *   same ids in the same order: a read after its lease ended lands on another request's bytes
 *   at once, the failure the simulator must make visible. A freed cached block goes to the
 *   back, a request's blocks in reverse (its tail is evicted first): least recently used.
 * - Allocating a cached free block evicts it (BlockRemoved). A prefix hit takes a reference
 *   on a block, free or in use, and takes it out of the queue.
 * - Without caching, blocks never get a hash and the pool is the LIFO allocator it replaces.
 */
export class BlockPool {
  readonly numBlocks: number
  readonly blockSize: number
  readonly enableCaching: boolean
  readonly #hashSeed: number
  readonly #onEvent: ((event: BlockEvent) => void) | undefined
  readonly #refs: Uint32Array
  readonly #hash: (bigint | undefined)[]
  readonly #byHash = new Map<bigint, number>()
  // The free queue, a doubly linked list over block ids.
  readonly #prev: Int32Array
  readonly #next: Int32Array
  readonly #queued: Uint8Array
  #head = NONE
  #tail = NONE
  #free = 0

  constructor(opts: BlockPoolOptions) {
    const { numBlocks, blockSize } = opts
    if (!Number.isInteger(numBlocks) || numBlocks < 1) throw new RangeError(`numBlocks must be a positive integer, got ${numBlocks}`)
    if (!Number.isInteger(blockSize) || blockSize < 1) throw new RangeError(`blockSize must be a positive integer, got ${blockSize}`)
    this.numBlocks = numBlocks
    this.blockSize = blockSize
    this.enableCaching = opts.enableCaching
    this.#hashSeed = opts.hashSeed
    this.#onEvent = opts.onEvent
    this.#refs = new Uint32Array(numBlocks)
    this.#hash = new Array<bigint | undefined>(numBlocks).fill(undefined)
    this.#prev = new Int32Array(numBlocks)
    this.#next = new Int32Array(numBlocks)
    this.#queued = new Uint8Array(numBlocks)
    // A fresh pool hands out 0, 1, 2, ... (easy to read in tests and logs).
    for (let id = 0; id < numBlocks; id++) this.#pushBack(id)
  }

  /** Blocks nobody references (cached or not): what can still be allocated. */
  get freeCount(): number {
    return this.#free
  }

  /** Blocks some request references: vLLM's kv_cache_usage_perc counts these. */
  get usedCount(): number {
    return this.numBlocks - this.#free
  }

  /** Blocks that hold a hash (free or in use): what a prefix can hit. */
  get cachedCount(): number {
    return this.#byHash.size
  }

  /** The hashes of a sequence's full blocks (none without caching: nothing would use them). */
  hashes(tokens: ArrayLike<number>): bigint[] {
    return this.enableCaching ? chainedBlockHashes(tokens, this.blockSize, this.#hashSeed) : []
  }

  /**
   * The cached blocks holding the longest prefix of `hashes` (block i's hash chains blocks
   * 0..i), at most `maxBlocks` of them. Takes no reference: see acquire.
   */
  match(hashes: readonly bigint[], maxBlocks = hashes.length): number[] {
    const out: number[] = []
    if (!this.enableCaching) return out
    const n = Math.min(maxBlocks, hashes.length)
    for (let i = 0; i < n; i++) {
      const id = this.#byHash.get(hashes[i] as bigint)
      if (id === undefined) break
      out.push(id)
    }
    return out
  }

  /**
   * `total` blocks for a sequence whose full blocks hash to `hashes`: its cached prefix (at
   * most `maxHit` blocks, referenced) then fresh blocks, all or nothing. `hit` is how many
   * came from the cache.
   */
  acquire(hashes: readonly bigint[], total: number, maxHit = total): { blocks: number[]; hit: number } {
    const hits = this.match(hashes, Math.min(maxHit, total))
    // Hits on free blocks leave the queue, so they are not there for the fresh part.
    let freeHits = 0
    for (const id of hits) if (this.#refs[id] === 0) freeHits++
    const fresh = total - hits.length
    if (fresh > this.#free - freeHits) throw new SIM_ERR_KV_CAPACITY(total, this.#free)
    this.touch(hits)
    return { blocks: [...hits, ...this.allocate(fresh)], hit: hits.length }
  }

  /** Takes a reference on each block (a prefix hit), out of the free queue if it was free. */
  touch(ids: readonly number[]): void {
    for (const id of ids) {
      this.#check(id)
      if (this.#refs[id] === 0) this.#unlink(id)
      this.#refs[id] = (this.#refs[id] as number) + 1
    }
  }

  /** `n` fresh blocks, all or nothing; evicts the cached free blocks it takes. */
  allocate(n: number): number[] {
    // A 503, like an engine out of KV blocks.
    if (n > this.#free) throw new SIM_ERR_KV_CAPACITY(n, this.#free)
    const out: number[] = []
    const evicted: bigint[] = []
    for (let i = 0; i < n; i++) {
      const id = this.#head
      this.#unlink(id)
      const hash = this.#hash[id]
      if (hash !== undefined) {
        this.#hash[id] = undefined
        this.#byHash.delete(hash)
        evicted.push(hash)
      }
      this.#refs[id] = 1
      out.push(id)
    }
    // One event a block, as vLLM's _maybe_evict_cached_block sends them.
    for (const hash of evicted) this.#onEvent?.({ type: 'BlockRemoved', blockHashes: [hash] })
    return out
  }

  /**
   * Gives full blocks their hashes: `blocks[i]` holds block i of a sequence whose full
   * blocks hash to `hashes`, `tokens` its token ids. Blocks before `from` are already cached
   * (the prefix hit). A hash some other block already holds stays with that block (the
   * second copy is freed uncached). One BlockStored per run of newly cached blocks.
   */
  cache(blocks: readonly number[], hashes: readonly bigint[], tokens: ArrayLike<number>, from = 0): void {
    if (!this.enableCaching) return
    const n = Math.min(blocks.length, hashes.length)
    let run: { start: number; hashes: bigint[] } | undefined
    const flush = (): void => {
      if (!run) return
      const { start } = run
      const tokenIds = Array.from({ length: run.hashes.length * this.blockSize }, (_, k) => tokens[start * this.blockSize + k] as number)
      this.#onEvent?.({ type: 'BlockStored', blockHashes: run.hashes, parentBlockHash: start === 0 ? null : (hashes[start - 1] as bigint), tokenIds, blockSize: this.blockSize })
      run = undefined
    }
    for (let i = from; i < n; i++) {
      const id = blocks[i] as number
      const hash = hashes[i] as bigint
      this.#check(id)
      if (this.#hash[id] !== undefined || this.#byHash.has(hash)) {
        flush()
        continue
      }
      this.#hash[id] = hash
      this.#byHash.set(hash, id)
      if (!run) run = { start: i, hashes: [] }
      run.hashes.push(hash)
    }
    flush()
  }

  /** Drops one reference on each block (a request's blocks, in order); unreferenced ones queue. */
  free(ids: readonly number[]): void {
    for (const id of ids) {
      this.#check(id)
      if (this.#refs[id] === 0) throw new Error(`block ${id} freed twice`)
    }
    const uncached: number[] = []
    for (const id of ids) {
      this.#refs[id] = (this.#refs[id] as number) - 1
      if (this.#refs[id] !== 0) continue
      if (this.#hash[id] === undefined) uncached.push(id)
    }
    // Uncached ones to the front, first freed first out; cached ones to the back, tail first.
    for (let i = uncached.length - 1; i >= 0; i--) this.#pushFront(uncached[i] as number)
    for (let i = ids.length - 1; i >= 0; i--) {
      const id = ids[i] as number
      if (this.#refs[id] === 0 && this.#hash[id] !== undefined && this.#queued[id] === 0) this.#pushBack(id)
    }
  }

  /** Forgets every hash (vLLM's reset_prefix_cache): AllBlocksCleared. */
  reset(): void {
    for (const id of this.#byHash.values()) this.#hash[id] = undefined
    this.#byHash.clear()
    if (this.enableCaching) this.#onEvent?.({ type: 'AllBlocksCleared' })
  }

  #check(id: number): void {
    if (!Number.isInteger(id) || id < 0 || id >= this.numBlocks) throw new RangeError(`block ${id} outside the pool`)
  }

  #pushBack(id: number): void {
    this.#prev[id] = this.#tail
    this.#next[id] = NONE
    if (this.#tail === NONE) this.#head = id
    else this.#next[this.#tail] = id
    this.#tail = id
    this.#queued[id] = 1
    this.#free++
  }

  #pushFront(id: number): void {
    this.#prev[id] = NONE
    this.#next[id] = this.#head
    if (this.#head === NONE) this.#tail = id
    else this.#prev[this.#head] = id
    this.#head = id
    this.#queued[id] = 1
    this.#free++
  }

  #unlink(id: number): void {
    const p = this.#prev[id] as number
    const n = this.#next[id] as number
    if (p === NONE) this.#head = n
    else this.#next[p] = n
    if (n === NONE) this.#tail = p
    else this.#prev[n] = p
    this.#queued[id] = 0
    this.#free--
  }
}
