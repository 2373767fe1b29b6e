/**
 * vLLM's scheduler admits at most `max_num_seqs` requests to run at once; the rest wait,
 * first come first served, and count in `vllm:num_requests_waiting`. A router that sends more
 * than that gets slower answers, not refusals, and can read the queue from /metrics: the
 * simulator keeps the same shape so admission that follows the engine (issue 23) has
 * something true to follow.
 */
export class SeqSlots {
  readonly #max: number
  #running = 0
  readonly #waiting: Array<() => void> = []

  constructor(max: number) {
    if (!(max >= 1)) throw new RangeError('maxNumSeqs must be >= 1')
    this.#max = max
  }

  get running(): number {
    return this.#running
  }

  get waiting(): number {
    return this.#waiting.length
  }

  /** Resolves once the request may run; rejects with the signal's reason if it leaves first. */
  acquire(signal: AbortSignal): Promise<void> {
    if (signal.aborted) return Promise.reject(signal.reason)
    if (this.#running < this.#max && this.#waiting.length === 0) {
      this.#running++
      return Promise.resolve()
    }
    return new Promise<void>((resolve, reject) => {
      const admit = (): void => {
        signal.removeEventListener('abort', onAbort)
        this.#running++
        resolve()
      }
      const onAbort = (): void => {
        const i = this.#waiting.indexOf(admit)
        if (i >= 0) this.#waiting.splice(i, 1)
        reject(signal.reason)
      }
      signal.addEventListener('abort', onAbort, { once: true })
      this.#waiting.push(admit)
    })
  }

  /** A running request finished: the longest waiting one runs. */
  release(): void {
    this.#running = Math.max(0, this.#running - 1)
    while (this.#running < this.#max) {
      const next = this.#waiting.shift()
      if (!next) return
      next()
    }
  }
}
