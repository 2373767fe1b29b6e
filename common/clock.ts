/**
 * Time is injected everywhere lease, TTL, timeout or backoff logic runs, so unit tests can
 * drive it by hand. `now()` is wall-clock milliseconds (what goes into a shared store);
 * `monotonic()` is milliseconds on a clock that never jumps (durations, deadlines). The system
 * clock's is the host's CLOCK_MONOTONIC (process.hrtime), like Python's `perf_counter` that vLLM
 * exports its lease deadlines on: every process on a host reads the same epoch, so a restarted
 * process's readings continue where the old one's would have been (performance.now() would
 * start again near 0 in every process).
 */
export interface Clock {
  now(): number
  monotonic(): number
  setTimeout(fn: () => void, ms: number): ClockTimer
  clearTimeout(timer: ClockTimer): void
}

export interface ClockTimer {
  unref?(): unknown
}

export const systemClock: Clock = Object.freeze({
  now: () => Date.now(),
  monotonic: () => Number(process.hrtime.bigint()) / 1e6,
  setTimeout: (fn: () => void, ms: number): ClockTimer => setTimeout(fn, ms),
  clearTimeout: (timer: ClockTimer) => clearTimeout(timer as NodeJS.Timeout),
})

interface ManualTimer extends ClockTimer {
  at: number
  fn: () => void
  seq: number
}

/** A clock that moves only when `advance` is called. Timers fire in deadline order. */
export class ManualClock implements Clock {
  #mono: number
  #wallOffset: number
  #timers = new Set<ManualTimer>()
  #seq = 0

  constructor(opts: { wall?: number; monotonic?: number } = {}) {
    this.#mono = opts.monotonic ?? 0
    this.#wallOffset = (opts.wall ?? 1_700_000_000_000) - this.#mono
  }

  now(): number {
    return this.#mono + this.#wallOffset
  }

  monotonic(): number {
    return this.#mono
  }

  setTimeout(fn: () => void, ms: number): ClockTimer {
    const timer: ManualTimer = { at: this.#mono + Math.max(0, ms), fn, seq: this.#seq++ }
    this.#timers.add(timer)
    return timer
  }

  clearTimeout(timer: ClockTimer): void {
    this.#timers.delete(timer as ManualTimer)
  }

  /** Moves time forward by `ms`, firing every timer that falls due on the way. */
  advance(ms: number): void {
    const target = this.#mono + ms
    for (;;) {
      let next: ManualTimer | undefined
      for (const t of this.#timers) {
        if (t.at <= target && (!next || t.at < next.at || (t.at === next.at && t.seq < next.seq))) next = t
      }
      if (!next) break
      this.#timers.delete(next)
      this.#mono = next.at
      next.fn()
    }
    this.#mono = target
  }

  get pendingTimers(): number {
    return this.#timers.size
  }
}
