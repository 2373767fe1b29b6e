import { createHash } from 'node:crypto'
import { writePromptKv } from './kv-bytes.js'
import type { KvRegion } from './kv-region.js'

/**
 * Output tokens are a pure function of the prompt's KV bytes: a SHA-256 digest of every
 * position's bytes, in position order, seeds a PRNG, and each next token mixes the PRNG with
 * the previous token. The digest reads the blocks the engine actually holds, so a stale,
 * partial or misplaced KV read yields different text, as it would on a GPU.
 */

/** The output vocabulary: readable words, so a wrong answer is visible at a glance. */
export const WORDS: readonly string[] = Object.freeze([
  'alpha', 'bravo', 'charlie', 'delta', 'echo', 'foxtrot', 'golf', 'hotel',
  'india', 'juliett', 'kilo', 'lima', 'mike', 'november', 'oscar', 'papa',
  'quebec', 'romeo', 'sierra', 'tango', 'uniform', 'victor', 'whiskey', 'xray',
  'yankee', 'zulu', 'amber', 'basalt', 'cobalt', 'dune', 'ember', 'fjord',
  'granite', 'harbor', 'iris', 'jade', 'kestrel', 'lagoon', 'meadow', 'nectar',
  'onyx', 'prairie', 'quartz', 'river', 'saffron', 'tundra', 'umber', 'valley',
  'willow', 'xenon', 'yarrow', 'zephyr', 'anchor', 'beacon', 'canyon', 'drift',
  'estuary', 'falcon', 'glacier', 'heron', 'island', 'jasper', 'kelp', 'lantern',
])

/** SHA-256 over positions [0, numTokens) held in `blockIds`. */
export function kvDigest(region: KvRegion, blockIds: readonly number[], numTokens: number): Buffer {
  const hash = createHash('sha256')
  let left = numTokens
  for (const block of blockIds) {
    if (left <= 0) break
    const n = Math.min(left, region.blockSize)
    hash.update(region.blockView(block, n))
    left -= n
  }
  if (left > 0) throw new RangeError(`${numTokens} positions need more than ${blockIds.length} blocks`)
  return hash.digest()
}

/** `count` output token ids (indexes into WORDS) from a KV digest. */
export function generateTokens(digest: Uint8Array, count: number): number[] {
  if (digest.byteLength < 16) throw new RangeError('digest too short')
  const dv = new DataView(digest.buffer, digest.byteOffset, 16)
  // sfc32, seeded with the digest's first 128 bits.
  let a = dv.getUint32(0, true)
  let b = dv.getUint32(4, true)
  let c = dv.getUint32(8, true)
  let d = dv.getUint32(12, true)
  const out: number[] = []
  let prev = 0
  for (let i = 0; i < count; i++) {
    const t = (a + b + d) | 0
    d = (d + 1) | 0
    a = b ^ (b >>> 9)
    b = (c + (c << 3)) | 0
    c = (c << 21) | (c >>> 11)
    c = (c + t) | 0
    const next = ((t >>> 0) ^ Math.imul(prev + 1, 0x9e3779b1)) >>> 0
    prev = next % WORDS.length
    out.push(prev)
  }
  return out
}

/** `count` output tokens from the KV of positions [0, numTokens) held in `blockIds`. */
export function tokensFromKv(region: KvRegion, blockIds: readonly number[], numTokens: number, count: number): number[] {
  return generateTokens(kvDigest(region, blockIds, numTokens), count)
}

/**
 * Prefill then generate: writes the prompt's KV into `blockIds` (from position `from`: the
 * ones before are a prefix-cache hit) and generates from those bytes. The engine and the
 * oracle both go through here, so they cannot drift apart.
 */
export function prefillAndGenerate(region: KvRegion, blockIds: readonly number[], tokens: Uint32Array, count: number, from = 0): number[] {
  writePromptKv(region, blockIds, tokens, from)
  return tokensFromKv(region, blockIds, tokens.length, count)
}

/** Text of one output token: a leading space and a word, so concatenated chunks read well. */
export function detokenizeOne(id: number): string {
  const w = WORDS[id]
  if (w === undefined) throw new RangeError(`output token ${id} outside the vocabulary`)
  return ` ${w}`
}

export function detokenize(ids: readonly number[]): string {
  let out = ''
  for (const id of ids) out += detokenizeOne(id)
  return out
}
