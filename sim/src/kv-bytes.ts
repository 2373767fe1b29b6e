import { fmix } from '../../common/block-hash.js'
import type { KvRegion } from './kv-region.js'

/**
 * The KV bytes of token position i are a pure function of (tokens[0..i], i): a 64-bit prefix
 * hash (two 32-bit lanes) of the tokens so far, expanded by xorshift32 to bytesPerToken bytes.
 * Two prompts that share a prefix share those positions' bytes, like a real KV cache, and any
 * change at position j changes every position from j on.
 *
 * Bytes are written as native-endian 32-bit words (little-endian on every platform Node
 * supports for this project); the oracle uses the same code, so it always agrees.
 */

const GOLDEN = 0x9e3779b9


/**
 * Writes positions [from, tokens.length) of a prompt into `blockIds` (in order, blockSize
 * positions per block; those before `from` are a prefix-cache hit, already there). `blockIds`
 * must hold at least region.blocksFor(tokens.length) ids.
 */
export function writePromptKv(region: KvRegion, blockIds: readonly number[], tokens: Uint32Array, from = 0): void {
  const words = region.words
  const wordsPerToken = region.bytesPerToken / 4
  const blockWords = region.blockBytes / 4
  const blockSize = region.blockSize
  if (blockIds.length * blockSize < tokens.length) throw new RangeError(`${blockIds.length} blocks cannot hold ${tokens.length} positions`)
  let a = 0x6a09e667
  let b = 0xbb67ae85
  let blockIndex = 0
  let slot = 0
  let w = (blockIds[0] ?? 0) * blockWords
  for (let i = 0; i < tokens.length; i++) {
    const t = tokens[i] as number
    a = fmix((a ^ t) + Math.imul(i, GOLDEN))
    b = fmix(b + Math.imul(t ^ a, 0x27d4eb2f) + i)
    if (slot === blockSize) {
      slot = 0
      w = (blockIds[++blockIndex] as number) * blockWords
    }
    slot++
    if (i < from) {
      w += wordsPerToken
      continue
    }
    // xorshift32 must not start at 0; `| 1` keeps the seed odd.
    let s = (a ^ Math.imul(i + 1, GOLDEN)) | 1
    for (let k = 0; k < wordsPerToken; k++) {
      s ^= s << 13
      s ^= s >>> 17
      s ^= s << 5
      words[w++] = (s + b + k) >>> 0
    }
  }
}
