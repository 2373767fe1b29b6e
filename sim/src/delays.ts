import type { Clock } from '../../common/clock.js'

/**
 * Waits `ms` on the injected clock, or rejects with the signal's reason when it aborts (the
 * client went away, or the app is closing). Zero waits resolve at once so a zero-delay
 * simulator never yields to the timer queue.
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
