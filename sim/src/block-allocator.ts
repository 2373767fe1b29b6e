import { SIM_ERR_KV_CAPACITY } from './errors.js'

/**
 * Hands out KV block ids. Freed blocks go on top of a stack and are the next ones handed
 * out (LIFO), as in vLLM's free-block queue: a read after a lease expired therefore lands on
 * blocks that already hold another request's bytes, which is the failure the simulator must
 * make visible.
 */
export class BlockAllocator {
  readonly numBlocks: number
  readonly #free: number[]
  readonly #used: Uint8Array

  constructor(numBlocks: number) {
    if (!Number.isInteger(numBlocks) || numBlocks < 1) throw new RangeError(`numBlocks must be a positive integer, got ${numBlocks}`)
    this.numBlocks = numBlocks
    this.#used = new Uint8Array(numBlocks)
    // Reversed, so a fresh allocator hands out 0, 1, 2, ... (easy to read in tests and logs).
    this.#free = Array.from({ length: numBlocks }, (_, i) => numBlocks - 1 - i)
  }

  get freeCount(): number {
    return this.#free.length
  }

  get usedCount(): number {
    return this.numBlocks - this.#free.length
  }

  /** Allocates `n` blocks, all or nothing. */
  allocate(n: number): number[] {
    // A 503, like an engine out of KV blocks.
    if (n > this.#free.length) throw new SIM_ERR_KV_CAPACITY(n, this.#free.length)
    const out: number[] = []
    for (let i = 0; i < n; i++) {
      const id = this.#free.pop() as number
      this.#used[id] = 1
      out.push(id)
    }
    return out
  }

  /**
   * Returns blocks to the pool. They are pushed in reverse so that the next allocation of
   * the same size gets the same ids in the same order (the most recently freed first).
   */
  free(ids: readonly number[]): void {
    for (const id of ids) {
      if (!Number.isInteger(id) || id < 0 || id >= this.numBlocks) throw new RangeError(`block ${id} outside the pool`)
      if (this.#used[id] !== 1) throw new Error(`block ${id} freed twice`)
    }
    for (let i = ids.length - 1; i >= 0; i--) {
      const id = ids[i] as number
      this.#used[id] = 0
      this.#free.push(id)
    }
  }
}
