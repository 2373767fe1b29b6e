import { detokenizeOne, WORDS } from './generator.js'

/**
 * Stop criteria as vLLM applies them (v1 `check_stop` in the scheduler, stop strings in the
 * output processor's detokenizer):
 * - a token is checked only once more than `min_tokens` tokens exist (vLLM's min-tokens
 *   logits processor masks EOS and stop token ids before that, and the detokenizer checks
 *   stop strings only past `min_tokens`);
 * - EOS (unless `ignore_eos`), then `stop_token_ids`, then the length cap: a stop token that
 *   is also the last allowed token finishes by stop, so an EOS as P's one token means
 *   FINISHED_STOPPED and no `kv_transfer_params` (protocol reference §1.2, §8 item 1);
 * - EOS and stop-token-id texts are left out of the output (`stop_reason` null for EOS, the
 *   id for a stop token id), but the token counts in `completion_tokens`;
 * - stop strings: the first of `stop` (list order) found in the text ends it; the text is cut
 *   before the string, `stop_reason` is the string.
 */

/**
 * The model's EOS token id: one past the 64 words, so the generator never samples it on its
 * own. `eosAfterTokens` (SimConfig / `--eos-after-tokens`) makes the model sample it.
 */
export const EOS_TOKEN_ID = WORDS.length

export interface StopCriteria {
  stop: readonly string[]
  stopTokenIds: readonly number[]
  ignoreEos: boolean
  minTokens: number
  /** The engine samples EOS as output token N (1-based); null: never. */
  eosAfterTokens: number | null
}

export const NO_STOP: StopCriteria = Object.freeze({ stop: [], stopTokenIds: [], ignoreEos: false, minTokens: 0, eosAfterTokens: null })

export type FinishReason = 'length' | 'stop'

export interface Finished {
  /** The output tokens up to and including the one that stopped generation. */
  tokens: number[]
  /** Each token's share of `text` (stop tokens and cut stop strings give ''); joined = text. */
  pieces: string[]
  text: string
  finishReason: FinishReason
  /** vLLM's `stop_reason`: the stop string, the stop token id, or null (length, EOS). */
  stopReason: string | number | null
}

/**
 * Applies the stop criteria to the tokens the model would sample without them (`sampled`,
 * max_tokens long): where generation ends, the text, and why.
 */
export function applyStop(sampled: readonly number[], c: StopCriteria): Finished {
  const tokens: number[] = []
  // Start offsets of each token's text in the uncut text; a cut text clips them.
  const spans: [number, number][] = []
  let text = ''
  let finishReason: FinishReason = 'length'
  let stopReason: string | number | null = null
  let cutAt: number | undefined
  for (let i = 0; i < sampled.length; i++) {
    const position = i + 1
    const checked = position > c.minTokens
    let token = sampled[i] as number
    if (checked && !c.ignoreEos && c.eosAfterTokens === position) token = EOS_TOKEN_ID
    tokens.push(token)
    if (checked && token === EOS_TOKEN_ID) {
      spans.push([text.length, text.length])
      finishReason = 'stop'
      break
    }
    if (checked && c.stopTokenIds.includes(token)) {
      spans.push([text.length, text.length])
      finishReason = 'stop'
      stopReason = token
      break
    }
    const piece = detokenizeOne(token)
    const start = text.length
    text += piece
    spans.push([start, text.length])
    if (checked && c.stop.length > 0) {
      const hit = findStop(text, piece.length, c.stop)
      if (hit) {
        cutAt = hit.index
        finishReason = 'stop'
        stopReason = hit.stop
        break
      }
    }
  }
  if (cutAt !== undefined) text = text.slice(0, cutAt)
  const pieces = spans.map(([s, e]) => text.slice(Math.min(s, text.length), Math.min(e, text.length)))
  return { tokens, pieces, text, finishReason, stopReason }
}

/** vLLM's check_stop_strings: search only where the newest text could complete a match. */
function findStop(text: string, newChars: number, stops: readonly string[]): { stop: string; index: number } | undefined {
  for (const stop of stops) {
    if (stop === '') continue
    const index = text.indexOf(stop, Math.max(0, text.length - newChars - stop.length + 1))
    if (index !== -1) return { stop, index }
  }
  return undefined
}
