import { Readable } from 'node:stream'
import type { Dispatcher } from 'undici'
import { errorEvent, type CodedError, type RouterErrorCode } from '../errors.js'

type Mapped = CodedError & { code: RouterErrorCode }

export interface RelayHooks {
  /** The exchange's signal: when it aborts, the relay stops without writing anything more. */
  signal: AbortSignal
  /**
   * D's first whole frame: its KV read is over. `error`: the frame is D's own error event
   * (vLLM's streamed answer to a failed KV load under kv_load_failure_policy=fail).
   */
  onFirstFrame(kind: 'data' | 'error'): void
  /**
   * The stream ended: cleanly (`ok`), cleanly but carrying D's own error event
   * (`error_event`), or with the failure that ended it (already mapped).
   */
  onEnd(result: 'ok' | 'error_event' | Mapped): void
  mapError(err: unknown): Mapped
}

// A stream that never ends a frame is passed on anyway past this size.
const MAX_PENDING = 1 << 20

/** The end of the last complete SSE frame in `buf` (a blank line, LF or CRLF), or 0. */
export function frameEnd(buf: Buffer): number {
  const lf = buf.lastIndexOf('\n\n')
  const crlf = buf.lastIndexOf('\n\r\n')
  return Math.max(lf < 0 ? 0 : lf + 2, crlf < 0 ? 0 : crlf + 3)
}

// vLLM's streamed failure: `data: {"error": {...}}` (the OpenAI error shape) as a frame's data.
const ERROR_EVENT = /^data: ?\{\s*"error"\s*:/m
const ERROR_KEY = Buffer.from('"error"')

/** Whether whole frames `buf` hold an engine error event (a byte search first: most frames cannot). */
export function hasErrorEvent(buf: Buffer): boolean {
  return buf.includes(ERROR_KEY) && ERROR_EVENT.test(buf.toString('utf8'))
}

/**
 * Relays D's SSE body chunk by chunk, without buffering beyond one frame. Bytes go out at
 * frame boundaries, so when D cuts a frame mid-way the client never sees the broken half:
 * the stream ends with a whole error event (and [DONE]) instead. D's own error events pass
 * through as they are; the hooks hear of them.
 */
export function relaySse(body: Dispatcher.ResponseData['body'], hooks: RelayHooks): Readable {
  async function* frames(): AsyncGenerator<Buffer> {
    let pending: Buffer | undefined
    let first = true
    let sawErrorEvent = false
    const out = (whole: Buffer): Buffer => {
      const error = hasErrorEvent(whole)
      sawErrorEvent ||= error
      if (first) {
        first = false
        // Only the first frame counts here: an error after tokens is not a failed KV load.
        const end = whole.indexOf('\n\n')
        hooks.onFirstFrame(error && hasErrorEvent(end < 0 ? whole : whole.subarray(0, end + 2)) ? 'error' : 'data')
      }
      return whole
    }
    try {
      for await (const chunk of body as AsyncIterable<Buffer>) {
        const buf = pending ? Buffer.concat([pending, chunk]) : chunk
        const cut = buf.length > MAX_PENDING ? buf.length : frameEnd(buf)
        pending = cut < buf.length ? buf.subarray(cut) : undefined
        if (cut > 0) yield out(cut === buf.length ? buf : buf.subarray(0, cut))
      }
      if (pending) yield out(pending)
      hooks.onEnd(sawErrorEvent ? 'error_event' : 'ok')
    } catch (err) {
      if (hooks.signal.aborted) return
      const mapped = hooks.mapError(err)
      hooks.onEnd(mapped)
      yield Buffer.from(errorEvent(mapped))
    }
  }
  return Readable.from(frames(), { objectMode: false })
}
