/**
 * The simulated GPU KV cache: `numBlocks` blocks of `blockSize` token positions, each
 * position `bytesPerToken` bytes. The memory is handed in rather than allocated here so that
 * `--kv agent` can back it with a shared-memory mapping that the transfer agent registers
 * with NIXL; remote READs then land in exactly these bytes.
 */
export interface KvRegionOptions {
  /** Backing memory; at least numBlocks × blockSize × bytesPerToken bytes, 4-byte aligned. */
  memory: ArrayBuffer | Uint8Array
  blockSize: number
  bytesPerToken: number
  numBlocks: number
}

export class KvRegion {
  readonly blockSize: number
  readonly bytesPerToken: number
  readonly numBlocks: number
  readonly blockBytes: number
  /** The whole region as bytes (what gets registered for transfer). */
  readonly bytes: Uint8Array
  /** The same memory as 32-bit words; kv-bytes.ts writes through it for speed. */
  readonly words: Uint32Array

  constructor(opts: KvRegionOptions) {
    const { blockSize, bytesPerToken, numBlocks } = opts
    if (!Number.isInteger(blockSize) || blockSize < 1) throw new RangeError(`blockSize must be a positive integer, got ${blockSize}`)
    if (!Number.isInteger(bytesPerToken) || bytesPerToken < 8 || bytesPerToken % 8 !== 0) {
      throw new RangeError(`bytesPerToken must be a positive multiple of 8, got ${bytesPerToken}`)
    }
    if (!Number.isInteger(numBlocks) || numBlocks < 1) throw new RangeError(`numBlocks must be a positive integer, got ${numBlocks}`)
    this.blockSize = blockSize
    this.bytesPerToken = bytesPerToken
    this.numBlocks = numBlocks
    this.blockBytes = blockSize * bytesPerToken
    const need = this.blockBytes * numBlocks
    const mem = opts.memory instanceof Uint8Array ? opts.memory : new Uint8Array(opts.memory)
    if (mem.byteLength < need) throw new RangeError(`KV memory holds ${mem.byteLength} bytes, ${need} needed`)
    if (mem.byteOffset % 4 !== 0) throw new RangeError('KV memory must be 4-byte aligned')
    this.bytes = mem.subarray(0, need)
    this.words = new Uint32Array(mem.buffer, mem.byteOffset, need / 4)
  }

  /** A region on fresh process memory (the `--kv none` case and tests). */
  static allocate(opts: Omit<KvRegionOptions, 'memory'>): KvRegion {
    return new KvRegion({ ...opts, memory: new ArrayBuffer(opts.numBlocks * opts.blockSize * opts.bytesPerToken) })
  }

  /** Byte offset of token slot `slot` of block `block`. */
  offset(block: number, slot: number): number {
    if (block < 0 || block >= this.numBlocks || slot < 0 || slot >= this.blockSize) {
      throw new RangeError(`KV position (${block}, ${slot}) outside the region`)
    }
    return block * this.blockBytes + slot * this.bytesPerToken
  }

  /** The first `tokens` positions of a block (a view, not a copy). */
  blockView(block: number, tokens = this.blockSize): Uint8Array {
    const start = this.offset(block, 0)
    return this.bytes.subarray(start, start + tokens * this.bytesPerToken)
  }

  /** Blocks needed to hold `tokens` positions. */
  blocksFor(tokens: number): number {
    return Math.ceil(tokens / this.blockSize)
  }
}
