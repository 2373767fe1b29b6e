/**
 * Chained hashes of a token sequence's full KV blocks, as a prefix cache keys them: block i's
 * hash covers every token of blocks 0..i, so two prompts share block i's hash exactly when
 * they share their first (i + 1) × blockSize tokens. A partial last block has no hash (an
 * engine caches full blocks only).
 *
 * The simulator keys its cache with this (its engine hash, seeded per process, as vLLM's
 * NONE_HASH is random without PYTHONHASHSEED), and the router keys its index of every
 * engine's cache with it too, on its own seed: the router never needs an engine's hashes to
 * match its own, only the token ids an engine reports.
 *
 * 64 bits from two 32-bit lanes (murmur3's finalizer per token); a hash is a BigInt so it
 * travels as msgpack's unsigned 64-bit int, as vLLM's int block hashes do.
 */

/** murmur3's 32-bit finalizer: a cheap, well-mixed step (the simulator's KV bytes use it too). */
export function fmix(h: number): number {
  h ^= h >>> 16
  h = Math.imul(h, 0x85ebca6b)
  h ^= h >>> 13
  h = Math.imul(h, 0xc2b2ae35)
  h ^= h >>> 16
  return h >>> 0
}

const MASK32 = 0xffffffffn

/**
 * Hashes of the full blocks of `tokens[from·blockSize ..]`, chained from `parent` (the hash of
 * block from−1; undefined for the first block, where the seed starts the chain).
 */
export function chainedBlockHashes(tokens: ArrayLike<number>, blockSize: number, seed: number, parent?: bigint, from = 0): bigint[] {
  if (!Number.isInteger(blockSize) || blockSize < 1) throw new RangeError(`blockSize must be a positive integer, got ${blockSize}`)
  let a: number
  let b: number
  if (parent === undefined) {
    a = fmix((seed ^ 0x6a09e667) >>> 0)
    b = fmix((seed + 0xbb67ae85) >>> 0)
  } else {
    a = Number((parent >> 32n) & MASK32)
    b = Number(parent & MASK32)
  }
  const out: bigint[] = []
  const full = Math.floor(tokens.length / blockSize)
  for (let block = from; block < full; block++) {
    const start = block * blockSize
    for (let k = 0; k < blockSize; k++) {
      const t = tokens[start + k] as number
      a = fmix((a ^ t) + Math.imul(k + 1, 0x9e3779b9))
      b = fmix(b + Math.imul(t ^ a, 0x27d4eb2f))
    }
    // A block's hash is its lanes, so the next block continues from exactly this state.
    out.push((BigInt(a) << 32n) | BigInt(b))
  }
  return out
}
