/** Unread bytes past which the engine's socket is paused for a reader taking chunk by chunk. */
const HIGH_WATER = 64 * 1024

/**
 * An engine's answer body as undici's dispatch hands it over (upstream.ts): its chunks kept
 * until they are read, whole (`whole`) or as they come (async iteration, every chunk that
 * arrived meanwhile in one Buffer). It replaces undici's request() body, a Readable per
 * answer read through its async iterator, which made up much of the router's CPU per
 * request on the two-leg path (docs/benchmarks.md, "Router CPU per request").
 *
 * A reader that falls HIGH_WATER behind pauses the engine's socket (`pause` is the
 * dispatcher's answer to `push`), and catching up resumes it. A whole read never pauses.
 * When the answer fails, the chunks that came before the failure are still read first.
 */
export class AnswerBody implements AsyncIterable<Buffer> {
  readonly #resume: () => void
  #chunks: Buffer[] = []
  #unread = 0
  #paused = false
  #whole = false
  #state: 'open' | 'ended' | 'failed' = 'open'
  #error: unknown
  #wake: (() => void) | undefined

  /** `resume`: lets the engine's socket go on after `push` answered false. */
  constructor(resume: () => void) {
    this.#resume = resume
  }

  /** A chunk from the engine; false: pause the socket until the reader catches up. */
  push(chunk: Buffer): boolean {
    this.#chunks.push(chunk)
    this.#unread += chunk.length
    this.#notify()
    if (this.#whole || this.#unread < HIGH_WATER) return true
    this.#paused = true
    return false
  }

  end(): void {
    if (this.#state !== 'open') return
    this.#state = 'ended'
    this.#notify()
  }

  fail(err: unknown): void {
    if (this.#state !== 'open') return
    this.#state = 'failed'
    this.#error = err
    this.#notify()
  }

  /** The answer ended with a failure (the connection broke, the call was stopped). */
  get failed(): boolean {
    return this.#state === 'failed'
  }

  /** The whole body, once the engine has sent all of it. */
  async whole(): Promise<Buffer> {
    this.#whole = true
    this.#catchUp()
    while (this.#state === 'open') await this.#next()
    if (this.#state === 'failed') throw this.#error
    return this.#take()
  }

  async *[Symbol.asyncIterator](): AsyncGenerator<Buffer> {
    for (;;) {
      if (this.#chunks.length > 0) {
        const chunk = this.#take()
        this.#catchUp()
        yield chunk
      } else if (this.#state === 'ended') return
      else if (this.#state === 'failed') throw this.#error
      else await this.#next()
    }
  }

  #take(): Buffer {
    const chunks = this.#chunks
    const out = chunks.length === 1 ? (chunks[0] as Buffer) : Buffer.concat(chunks, this.#unread)
    this.#chunks = []
    this.#unread = 0
    return out
  }

  #catchUp(): void {
    if (!this.#paused) return
    this.#paused = false
    this.#resume()
  }

  #next(): Promise<void> {
    return new Promise((resolve) => (this.#wake = resolve))
  }

  #notify(): void {
    const wake = this.#wake
    this.#wake = undefined
    wake?.()
  }
}
