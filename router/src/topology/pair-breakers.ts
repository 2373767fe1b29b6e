import type { Clock } from '../../../common/clock.js'

/**
 * A circuit breaker per (prefiller, decoder) pair, fed by KV-load failures (DESIGN "Topology
 * and liveness"): such failures are often about the pair, not either engine (a broken link,
 * a NIXL endpoint in error state, mismatched layouts), so both engines stay healthy for
 * other pairs while this one rests. Consecutive failures open it; after `openMs` one trial
 * request is let through (half-open): success closes it, failure opens it again for twice as
 * long, up to `maxOpenMs`. Selection asks `blocked(p, d)` as one more filter.
 */
export interface PairBreakerPolicy {
  failureThreshold: number
  openMs: number
  maxOpenMs: number
}

export type PairState = 'closed' | 'open' | 'half_open'

interface Pair {
  failures: number
  openUntil: number
  openMs: number
  /** A half-open trial is in flight: no other request until it reports. */
  trial: boolean
}

export interface PairView {
  prefill: string
  decode: string
  state: PairState
  failures: number
  /** Monotonic ms left before a trial is allowed (open only). */
  retryInMs: number
}

export class PairBreakers {
  readonly #clock: Clock
  readonly #policy: PairBreakerPolicy
  readonly #pairs = new Map<string, Pair>()
  /** Pairs that opened and have not closed since (open or half-open). */
  #tripped = 0
  readonly #onOpen: ((prefill: string, decode: string) => void) | undefined

  constructor(opts: { clock: Clock; policy: PairBreakerPolicy; onOpen?: (prefill: string, decode: string) => void }) {
    if (!(opts.policy.failureThreshold >= 1)) throw new RangeError('failureThreshold must be >= 1')
    this.#clock = opts.clock
    this.#policy = opts.policy
    this.#onOpen = opts.onOpen
  }

  state(prefill: string, decode: string): PairState {
    const p = this.#pairs.get(key(prefill, decode))
    if (!p || p.openUntil === 0) return 'closed'
    return this.#clock.monotonic() < p.openUntil ? 'open' : 'half_open'
  }

  /** Whether selection must skip the pair now (open, or half-open with its trial in flight). */
  blocked(prefill: string, decode: string): boolean {
    const s = this.state(prefill, decode)
    if (s === 'closed') return false
    if (s === 'open') return true
    return (this.#pairs.get(key(prefill, decode)) as Pair).trial
  }

  /** The pair was chosen: a half-open pair's one trial starts. */
  chosen(prefill: string, decode: string): void {
    if (this.state(prefill, decode) === 'half_open') (this.#pairs.get(key(prefill, decode)) as Pair).trial = true
  }

  recordFailure(prefill: string, decode: string): void {
    const k = key(prefill, decode)
    const p = this.#pairs.get(k) ?? { failures: 0, openUntil: 0, openMs: this.#policy.openMs, trial: false }
    this.#pairs.set(k, p)
    const wasTrial = this.state(prefill, decode) === 'half_open'
    p.failures++
    p.trial = false
    if (wasTrial) p.openMs = Math.min(p.openMs * 2, this.#policy.maxOpenMs)
    if (wasTrial || p.failures >= this.#policy.failureThreshold) {
      if (p.openUntil === 0) this.#tripped++
      p.openUntil = this.#clock.monotonic() + p.openMs
      this.#onOpen?.(prefill, decode)
    }
  }

  recordSuccess(prefill: string, decode: string): void {
    this.#delete(key(prefill, decode))
  }

  /** Whether any pair is open or half-open: selection need not ask about each pair otherwise. */
  get anyTripped(): boolean {
    return this.#tripped > 0
  }

  #delete(k: string): void {
    const p = this.#pairs.get(k)
    if (p && p.openUntil !== 0) this.#tripped--
    this.#pairs.delete(k)
  }

  /** Pairs that are not closed (for GET /topology and metrics). */
  list(): PairView[] {
    const now = this.#clock.monotonic()
    const out: PairView[] = []
    for (const [k, p] of this.#pairs) {
      const [prefill, decode] = k.split('\u0000') as [string, string]
      const state = this.state(prefill, decode)
      if (state === 'closed' && p.failures === 0) continue
      out.push({ prefill, decode, state, failures: p.failures, retryInMs: state === 'open' ? p.openUntil - now : 0 })
    }
    return out
  }

  /** Forgets every pair of an instance (it left the topology). */
  forget(instanceId: string): void {
    for (const k of [...this.#pairs.keys()]) {
      const [p, d] = k.split('\u0000')
      if (p === instanceId || d === instanceId) this.#delete(k)
    }
  }
}

function key(prefill: string, decode: string): string {
  return `${prefill}\u0000${decode}`
}
