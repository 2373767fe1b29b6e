import { chainedBlockHashes } from '../../../common/block-hash.js'
import type { EngineHash, KvEvent } from './kv-events-wire.js'

/*
 * Which prompt prefixes each engine holds in its KV cache (issue 39 part 2), built from the
 * engines' own KV events. Keys are the router's chained hashes of token ids
 * (common/block-hash.ts, on the router's seed): two engines that hash with other seeds or
 * algorithms still agree here, because only their token ids count.
 *
 * - A BlockStored names the engine's hash of each block and of the block before the run
 *   (`parent_block_hash`); the router's hash of the run continues from its hash of that parent.
 *   A parent the index does not hold (an event lost, or evicted here by the cap) leaves the run
 *   unindexed (`orphaned`): without it the router cannot say which prefix the blocks extend.
 *   So is a run whose engine hashes cover more than its tokens (a LoRA adapter, a cache_salt,
 *   multimodal inputs: `keyed`), and with it every run chained from it: the router's hash of
 *   the tokens would say a plain prompt hits blocks it cannot use.
 * - BlockRemoved drops blocks by the engine's hash; AllBlocksCleared and `purge` (an engine
 *   restarted, peer_gone, a gap replay could not fill) drop the engine's whole index.
 * - Only the GPU tier of KV cache group 0 counts: that is what a request on the engine hits
 *   (an offloaded CPU copy must be loaded first; a hybrid model's other groups are not a
 *   prefix on their own).
 * - Bounded: at most `maxBlocksPerEngine` blocks per engine (the oldest stored go first, as a
 *   full engine evicts its least recently used) and `maxEngines` engines (the least recently
 *   updated go first), so the router's memory does not grow with what engines announce.
 */

export interface PrefixIndexOptions {
  /** The router's hash seed (fixed per router process; routers need not agree). */
  seed: number
  maxBlocksPerEngine: number
  maxEngines: number
}

/** What applying events did, for metrics. */
export interface Applied {
  stored: number
  removed: number
  /** Blocks not indexed: their parent was unknown. */
  orphaned: number
  /** Blocks not indexed: their hash covers more than their tokens. */
  keyed: number
  /** Blocks dropped to stay within the cap. */
  evicted: number
  cleared: boolean
}

const GPU = 'GPU'

class EngineBlocks {
  /** The engine's hash → the router's chained hash; insertion order is eviction order. */
  readonly byEngineHash = new Map<EngineHash, bigint>()
  /** The router's hash → how many of the engine's hashes name it (lora or group twins). */
  readonly blocks = new Map<bigint, number>()
  blockSize: number | undefined

  add(engineHash: EngineHash, routerHash: bigint): void {
    const old = this.byEngineHash.get(engineHash)
    if (old !== undefined) {
      // Stored again (freed and recomputed): now the newest.
      this.byEngineHash.delete(engineHash)
      this.byEngineHash.set(engineHash, old)
      return
    }
    this.byEngineHash.set(engineHash, routerHash)
    this.blocks.set(routerHash, (this.blocks.get(routerHash) ?? 0) + 1)
  }

  remove(engineHash: EngineHash): boolean {
    const routerHash = this.byEngineHash.get(engineHash)
    if (routerHash === undefined) return false
    this.byEngineHash.delete(engineHash)
    const n = (this.blocks.get(routerHash) ?? 1) - 1
    if (n <= 0) this.blocks.delete(routerHash)
    else this.blocks.set(routerHash, n)
    return true
  }

  evictOldest(): void {
    const oldest = this.byEngineHash.keys().next()
    if (!oldest.done) this.remove(oldest.value)
  }
}

/** A prompt's block hashes, computed once per block size and shared by every engine's lookup. */
export class PromptBlocks {
  readonly #tokens: ArrayLike<number>
  readonly #seed: number
  readonly #bySize = new Map<number, bigint[]>()

  constructor(tokens: ArrayLike<number>, seed: number) {
    this.#tokens = tokens
    this.#seed = seed
  }

  get tokenCount(): number {
    return this.#tokens.length
  }

  hashes(blockSize: number): bigint[] {
    let h = this.#bySize.get(blockSize)
    if (h === undefined) {
      h = chainedBlockHashes(this.#tokens, blockSize, this.#seed)
      this.#bySize.set(blockSize, h)
    }
    return h
  }
}

export class PrefixIndex {
  readonly #o: PrefixIndexOptions
  /** engine_id → its blocks; insertion order is least recently updated first. */
  readonly #engines = new Map<string, EngineBlocks>()

  constructor(o: PrefixIndexOptions) {
    for (const k of ['maxBlocksPerEngine', 'maxEngines'] as const) {
      if (!(Number.isInteger(o[k]) && o[k] > 0)) throw new RangeError(`${k} must be a positive integer, got ${o[k]}`)
    }
    this.#o = o
  }

  /** The prompt's blocks on this router's seed, for `cachedTokens`. */
  prompt(tokens: ArrayLike<number>): PromptBlocks {
    return new PromptBlocks(tokens, this.#o.seed)
  }

  /** Applies one engine's events in order. */
  apply(engineId: string, events: readonly KvEvent[]): Applied {
    const out: Applied = { stored: 0, removed: 0, orphaned: 0, keyed: 0, evicted: 0, cleared: false }
    let e = this.#touch(engineId)
    for (const event of events) {
      switch (event.type) {
        case 'AllBlocksCleared':
          this.#engines.delete(engineId)
          e = this.#touch(engineId)
          out.cleared = true
          break
        case 'BlockRemoved':
          if (!counts(event.medium, event.groupIdx)) break
          for (const h of event.blockHashes) if (e.remove(h)) out.removed++
          break
        case 'BlockStored':
          if (!counts(event.medium, event.groupIdx)) break
          this.#store(e, event, out)
          break
      }
    }
    return out
  }

  #store(e: EngineBlocks, event: Extract<KvEvent, { type: 'BlockStored' }>, out: Applied): void {
    const n = event.blockHashes.length
    if (e.blockSize !== undefined && e.blockSize !== event.blockSize) {
      // One block size per engine (vLLM's is fixed at start); another means a new engine under the old id.
      e.byEngineHash.clear()
      e.blocks.clear()
    }
    e.blockSize = event.blockSize
    if (!event.tokensOnly) {
      out.keyed += n
      return
    }
    let parent: bigint | undefined
    if (event.parentBlockHash !== null) {
      parent = e.byEngineHash.get(event.parentBlockHash)
      if (parent === undefined) {
        out.orphaned += n
        return
      }
    }
    const routerHashes = chainedBlockHashes(event.tokenIds, event.blockSize, this.#o.seed, parent)
    // token_ids cover the run's full blocks; fewer (a malformed event) indexes what they cover.
    const k = Math.min(n, routerHashes.length)
    out.orphaned += n - k
    for (let i = 0; i < k; i++) {
      e.add(event.blockHashes[i] as EngineHash, routerHashes[i] as bigint)
      out.stored++
    }
    while (e.byEngineHash.size > this.#o.maxBlocksPerEngine) {
      e.evictOldest()
      out.evicted++
    }
  }

  /** Forgets an engine (restarted, gone, or its stream broke past what replay can fill). */
  purge(engineId: string): boolean {
    return this.#engines.delete(engineId)
  }

  /**
   * How many leading tokens of the prompt the engine holds: whole blocks, and at most
   * `tokenCount − 1` (an engine always computes the last token: vLLM's max_cache_hit_length).
   */
  cachedTokens(engineId: string, prompt: PromptBlocks): number {
    const e = this.#engines.get(engineId)
    if (e === undefined || e.blockSize === undefined || e.blocks.size === 0) return 0
    const hashes = prompt.hashes(e.blockSize)
    const usable = Math.floor(Math.max(prompt.tokenCount - 1, 0) / e.blockSize)
    let blocks = 0
    while (blocks < usable && e.blocks.has(hashes[blocks] as bigint)) blocks++
    return blocks * e.blockSize
  }

  /** Blocks held for an engine (for metrics and /topology). */
  blocks(engineId: string): number {
    return this.#engines.get(engineId)?.byEngineHash.size ?? 0
  }

  /** Whether any engine's index holds a block (else no prompt can hit: no lookup is worth it). */
  holdsAny(): boolean {
    for (const e of this.#engines.values()) if (e.blocks.size > 0) return true
    return false
  }

  engines(): string[] {
    return [...this.#engines.keys()]
  }

  #touch(engineId: string): EngineBlocks {
    let e = this.#engines.get(engineId)
    if (e) this.#engines.delete(engineId)
    else e = new EngineBlocks()
    this.#engines.set(engineId, e)
    while (this.#engines.size > this.#o.maxEngines) this.#engines.delete(this.#engines.keys().next().value as string)
    return e
  }
}

const counts = (medium: string | null, groupIdx: number): boolean => (medium === null || medium.toUpperCase() === GPU) && groupIdx === 0
