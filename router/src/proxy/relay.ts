import { Readable } from 'node:stream'
import type { Dispatcher } from 'undici'
import { errorEvent, type CodedError, type RouterErrorCode } from '../errors.js'

type Mapped = CodedError & { code: RouterErrorCode }

export interface RelayHooks {
  /** The exchange's signal: when it aborts, the relay stops without writing anything more. */
  signal: AbortSignal
  /** D's first body bytes: its KV read is over. */
  onFirstChunk(): void
  /** The stream ended: cleanly, or with the failure that ended it (already mapped). */
  onEnd(result: 'ok' | Mapped): void
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

/**
 * Relays D's SSE body chunk by chunk, without buffering beyond one frame. Bytes go out at
 * frame boundaries, so when D cuts a frame mid-way the client never sees the broken half:
 * the stream ends with a whole error event (and [DONE]) instead.
 */
export function relaySse(body: Dispatcher.ResponseData['body'], hooks: RelayHooks): Readable {
  async function* frames(): AsyncGenerator<Buffer> {
    let pending: Buffer | undefined
    let first = true
    try {
      for await (const chunk of body as AsyncIterable<Buffer>) {
        if (first) {
          first = false
          hooks.onFirstChunk()
        }
        const buf = pending ? Buffer.concat([pending, chunk]) : chunk
        const cut = buf.length > MAX_PENDING ? buf.length : frameEnd(buf)
        pending = cut < buf.length ? buf.subarray(cut) : undefined
        if (cut > 0) yield cut === buf.length ? buf : buf.subarray(0, cut)
      }
      if (pending) yield pending
      hooks.onEnd('ok')
    } catch (err) {
      if (hooks.signal.aborted) return
      const mapped = hooks.mapError(err)
      hooks.onEnd(mapped)
      yield Buffer.from(errorEvent(mapped))
    }
  }
  return Readable.from(frames(), { objectMode: false })
}
