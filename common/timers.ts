import type { Clock, ClockTimer } from './clock.js'

/**
 * Waits `ms` on the injected clock, or rejects with the signal's reason when it aborts (a
 * client went away, a service is closing). Zero waits resolve at once, so a zero delay never
 * yields to the timer queue.
 */
export function sleep(clock: Clock, ms: number, signal?: AbortSignal): Promise<void> {
  if (signal?.aborted) return Promise.reject(signal.reason as Error)
  if (ms <= 0) return Promise.resolve()
  return new Promise((resolve, reject) => {
    const onAbort = (): void => {
      clock.clearTimeout(timer)
      reject(signal?.reason as Error)
    }
    const timer = clock.setTimeout(() => {
      signal?.removeEventListener('abort', onAbort)
      resolve()
    }, ms)
    signal?.addEventListener('abort', onAbort, { once: true })
  })
}

export interface Every {
  /** Cancels the next run; a run in progress finishes but schedules none after it. */
  stop(): void
  readonly stopped: boolean
}

export interface EveryOptions {
  /** Where a failed run's error goes (the schedule goes on); default: thrown, as a timer would. */
  onError?: (err: unknown) => void
}

/**
 * Runs `fn` every `ms` on the injected clock until `stop()`. Runs never overlap: the next
 * one is scheduled `ms` after the previous one settled (a slow async run delays the next
 * instead of piling up). The first run is `ms` from now. Timers are unref'd where the clock
 * supports it, so a periodic task never keeps a process alive by itself.
 */
export function every(clock: Clock, ms: number, fn: () => void | Promise<void>, opts: EveryOptions = {}): Every {
  if (!(ms > 0)) throw new RangeError(`every: interval must be positive, got ${ms}`)
  const onError =
    opts.onError ??
    ((err: unknown) => {
      throw err
    })
  let timer: ClockTimer | undefined
  let stopped = false
  const schedule = (): void => {
    if (stopped) return
    timer = clock.setTimeout(tick, ms)
    timer.unref?.()
  }
  const tick = (): void => {
    timer = undefined
    let result: void | Promise<void>
    try {
      result = fn()
    } catch (err) {
      schedule()
      onError(err)
      return
    }
    if (result instanceof Promise) {
      result.then(schedule, (err: unknown) => {
        schedule()
        onError(err)
      })
    } else schedule()
  }
  schedule()
  return {
    stop(): void {
      stopped = true
      if (timer) clock.clearTimeout(timer)
      timer = undefined
    },
    get stopped(): boolean {
      return stopped
    },
  }
}
