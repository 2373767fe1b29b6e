// What every store module shares, without Redis: a memory-store router loads none of ioredis.

/** What the store modules log: the outage and the recovery, once each (pino fits). */
export interface StoreLogger {
  info(obj: object, msg: string): void
  warn(obj: object, msg: string): void
}

/** `ok` while the command connection is ready; `degraded` from its loss until it is ready again. */
export interface StoreState {
  readonly state: 'ok' | 'degraded'
  /** Wall ms (clock.now()) of the last change. */
  readonly since: number
  /** The last error the connection reported, if any (never contains the URL's password). */
  readonly error?: string
}

export type StoreStateListener = (state: StoreState) => void

/**
 * Calls every listener with `args`; one that throws is logged and does not stop the others
 * (listeners run inside Redis client events and timers, where a throw would crash the process).
 */
export function callEach<A extends unknown[]>(listeners: Iterable<(...args: A) => void>, args: A, logger: StoreLogger | undefined): void {
  for (const fn of [...listeners]) {
    try {
      fn(...args)
    } catch (err) {
      logger?.warn({ err: err instanceof Error ? err.message : String(err) }, 'a shared-store listener failed')
    }
  }
}
