/**
 * A deterministic stand-in for a model tokenizer. It only has to be stable (the same text
 * always gives the same ids on every process) and fast: a 200 KiB prompt is one regex pass
 * and one FNV-1a hash per piece.
 */

/** Vocabulary size of the simulated model (GPT-2's, so ids look familiar). */
export const VOCAB_SIZE = 50257

// A piece is an optional leading space plus a run of word characters, an optional leading
// space plus a run of ASCII punctuation, or a run of whitespace. Like GPT-2's pre-tokenizer,
// the leading space belongs to the next word, so "a b" is two tokens, not three.
const PIECE = /[ ]?[^\s!-/:-@[-`{-~]+|[ ]?[!-/:-@[-`{-~]+|\s+/g

/** FNV-1a over UTF-16 code units; unsigned 32-bit. */
function fnv1a(s: string): number {
  let h = 0x811c9dc5
  for (let i = 0; i < s.length; i++) {
    h ^= s.charCodeAt(i)
    h = Math.imul(h, 0x01000193)
  }
  return h >>> 0
}

/** Splits text into pieces; exported for tests and for readers who want to see the split. */
export function pieces(text: string): string[] {
  return text.match(PIECE) ?? []
}

export function tokenize(text: string): Uint32Array {
  const parts = pieces(text)
  const ids = new Uint32Array(parts.length)
  for (let i = 0; i < parts.length; i++) ids[i] = fnv1a(parts[i] as string) % VOCAB_SIZE
  return ids
}
