import { Readable } from 'node:stream'
import { errorEvent, isRouterError, type CodedError, type RouterErrorCode } from '../errors.js'
import { withPrefillFacts, type PrefillFacts } from './prefill-facts.js'

type Mapped = CodedError & { code: RouterErrorCode }

export interface RelayHooks {
  /** The exchange's signal: when it aborts, the relay stops without writing anything more. */
  signal: AbortSignal
  /**
   * D's first frame that says how its KV read went (firstVerdict): `data`, the read is over;
   * `error`, D's own error event (vLLM's streamed answer to a failed KV load under
   * kv_load_failure_policy=fail). A chat stream's role preamble comes before either. An
   * error returned ends the stream in its place (the frame is not passed on).
   */
  onFirstFrame(kind: 'data' | 'error'): Mapped | undefined
  /**
   * The stream ended: cleanly (`ok`), cleanly but carrying D's own error event
   * (`error_event`), or with the failure that ended it (already mapped).
   */
  onEnd(result: 'ok' | 'error_event' | Mapped): void
  mapError(err: unknown): Mapped
  /** Whole frames on their way out, changed (P's facts in D's usage chunk: withUsageFacts). */
  rewrite?: (frames: Buffer) => Buffer
}

// A stream that never ends a frame is passed on anyway past this size.
const MAX_PENDING = 1 << 20

/** The end of the last complete SSE frame in `buf` (a blank line, LF or CRLF), or 0. */
export function frameEnd(buf: Buffer): number {
  const lf = buf.lastIndexOf('\n\n')
  const crlf = buf.lastIndexOf('\n\r\n')
  return Math.max(lf < 0 ? 0 : lf + 2, crlf < 0 ? 0 : crlf + 3)
}

/** Splits SSE text into its `data:` payloads; returns them and the unfinished tail. */
export function sseData(text: string): { data: string[]; rest: string } {
  const frames = text.split(/\r?\n\r?\n/)
  const rest = frames.pop() ?? ''
  const data: string[] = []
  for (const f of frames) {
    for (const line of f.split(/\r?\n/)) if (line.startsWith('data:')) data.push(line.slice(5).trimStart())
  }
  return { data, rest }
}

const USAGE_KEY = Buffer.from('"usage":{')

/**
 * Whole frames with P's facts in the usage chunk's prompt_tokens_details (prefill-facts.ts):
 * a stream's usage, like a whole answer's, must count the prompt tokens P found cached, not
 * D's view of a prompt it read over NIXL. Frames without a usage object go out as they came.
 */
export function withUsageFacts(frames: Buffer, facts: PrefillFacts, chat: boolean): Buffer {
  if (!frames.includes(USAGE_KEY)) return frames
  const text = frames.toString('utf8').replace(/^data: ?(\{.*\})\r?$/gm, (line, json: string) => {
    try {
      const chunk = JSON.parse(json) as unknown
      if (typeof chunk === 'object' && chunk !== null && typeof (chunk as { usage?: unknown }).usage === 'object') {
        return `data: ${JSON.stringify(withPrefillFacts(chunk as Record<string, unknown>, { ...(facts.cachedTokens !== undefined ? { cachedTokens: facts.cachedTokens } : {}) }, chat))}`
      }
    } catch {
      // not JSON: as it came
    }
    return line
  })
  return Buffer.from(text)
}

// vLLM's streamed failure: `data: {"error": {...}}` (the OpenAI error shape) as a frame's data.
const ERROR_EVENT = /^data: ?\{\s*"error"\s*:/m
const ERROR_KEY = Buffer.from('"error"')

/** Whether whole frames `buf` hold an engine error event (a byte search first: most frames cannot). */
export function hasErrorEvent(buf: Buffer): boolean {
  return buf.includes(ERROR_KEY) && ERROR_EVENT.test(buf.toString('utf8'))
}

/**
 * A chat stream's role preamble: every choice's delta names the role and carries no content,
 * no finish. vLLM 0.32 sends it for each choice before anything else, also before the error
 * event of a failed KV load, so it says nothing about D's read.
 */
export function isRolePreamble(chunk: unknown): boolean {
  const choices = (chunk as { choices?: unknown } | null)?.choices
  if (!Array.isArray(choices) || choices.length === 0) return false
  return choices.every((c: { delta?: { role?: unknown; content?: unknown; tool_calls?: unknown }; finish_reason?: unknown }) => {
    const d = c?.delta
    return typeof d?.role === 'string' && !d.content && !d.tool_calls && !c.finish_reason
  })
}

/**
 * What one parsed data frame says about D's KV read: `error` for D's own error event, `data`
 * for anything else but a chat role preamble, undefined for that preamble (it comes first).
 */
export function verdictOf(chunk: unknown): 'data' | 'error' | undefined {
  if (typeof chunk === 'object' && chunk !== null && 'error' in chunk) return 'error'
  return isRolePreamble(chunk) ? undefined : 'data'
}

/**
 * What whole frames `buf` say about D's KV read: the first data frame that is not a role
 * preamble decides (`error` for D's own error event); undefined while none has come. Only
 * the frames before the verdict are parsed.
 */
export function firstVerdict(buf: Buffer): 'data' | 'error' | undefined {
  for (const frame of buf.toString('utf8').split(/\r?\n\r?\n/)) {
    const data = frame
      .split(/\r?\n/)
      .filter((l) => l.startsWith('data:'))
      .map((l) => l.slice(5).trimStart())
      .join('\n')
    if (!data) continue
    if (data === '[DONE]') return 'data'
    let chunk: unknown
    try {
      chunk = JSON.parse(data)
    } catch {
      return 'data'
    }
    const verdict = verdictOf(chunk)
    if (verdict) return verdict
  }
  return undefined
}

/**
 * Relays D's SSE body chunk by chunk, without buffering beyond one frame. Bytes go out at
 * frame boundaries, so when D cuts a frame mid-way the client never sees the broken half:
 * the stream ends with a whole error event (and [DONE]) instead. D's own error events pass
 * through as they are; the hooks hear of them.
 */
export function relaySse(body: AsyncIterable<Buffer>, hooks: RelayHooks): Readable {
  async function* frames(): AsyncGenerator<Buffer> {
    let pending: Buffer | undefined
    let judged = false
    let sawErrorEvent = false
    const out = (whole: Buffer): Buffer => {
      sawErrorEvent ||= hasErrorEvent(whole)
      if (!judged) {
        // Only the first telling frame counts: an error after tokens is not a failed KV load.
        const verdict = firstVerdict(whole)
        if (verdict) {
          judged = true
          const stop = hooks.onFirstFrame(verdict)
          if (stop) throw stop
        }
      }
      return hooks.rewrite ? hooks.rewrite(whole) : whole
    }
    try {
      for await (const chunk of body) {
        const buf = pending ? Buffer.concat([pending, chunk]) : chunk
        const cut = buf.length > MAX_PENDING ? buf.length : frameEnd(buf)
        pending = cut < buf.length ? buf.subarray(cut) : undefined
        if (cut > 0) yield out(cut === buf.length ? buf : buf.subarray(0, cut))
      }
      if (pending) yield out(pending)
      if (!judged) hooks.onFirstFrame(sawErrorEvent ? 'error' : 'data')
      hooks.onEnd(sawErrorEvent ? 'error_event' : 'ok')
    } catch (err) {
      if (hooks.signal.aborted) return
      const mapped = isRouterError(err) ? err : hooks.mapError(err)
      hooks.onEnd(mapped)
      yield Buffer.from(errorEvent(mapped))
    }
  }
  return Readable.from(frames(), { objectMode: false })
}
