import type { Random } from '../../common/random.js'
import type { SimConfig } from '../../schemas/sim-config.js'

export type Faults = SimConfig['faults']
/** A partial update as POST /sim/faults takes it; crashAfter or eosAfterTokens null clears it. */
export type FaultsPatch = Partial<Omit<Faults, 'crashAfter' | 'eosAfterTokens'>> & { crashAfter?: number | null; eosAfterTokens?: number | null }

/** What to do to one request, decided once when it is accepted. */
export type FaultAction = 'crash' | 'error' | 'garbage' | 'stall' | 'disconnect' | 'kv_load_failure' | 'none'

/**
 * Fault injection state, changeable at run time. Each rate is an independent draw from the
 * injected Random, in a fixed order (error, garbage, stall, disconnect, KV load failure), so a seeded
 * simulator injects the same faults into the same request sequence.
 */
export class FaultState {
  #faults: Faults
  #accepted = 0

  constructor(initial: Faults) {
    this.#faults = { ...initial }
  }

  get current(): Readonly<Faults> {
    return { ...this.#faults }
  }

  /** Requests counted toward crashAfter so far. */
  get accepted(): number {
    return this.#accepted
  }

  update(patch: FaultsPatch): Readonly<Faults> {
    const { crashAfter, eosAfterTokens, ...rest } = patch
    const next: Faults = { ...this.#faults, ...rest }
    if (eosAfterTokens === null) delete next.eosAfterTokens
    else if (eosAfterTokens !== undefined) next.eosAfterTokens = eosAfterTokens
    if (crashAfter === null) delete next.crashAfter
    else if (crashAfter !== undefined) {
      next.crashAfter = crashAfter
      // A new crash budget counts from now, so tests can arm it after warm-up traffic.
      this.#accepted = 0
    }
    this.#faults = next
    return this.current
  }

  /** Counts an accepted completion request and picks its fault. */
  decide(random: Random): FaultAction {
    this.#accepted++
    const f = this.#faults
    if (f.crashAfter !== undefined && this.#accepted >= f.crashAfter) return 'crash'
    if (f.errorRate > 0 && random.next() < f.errorRate) return 'error'
    if (f.garbageRate > 0 && random.next() < f.garbageRate) return 'garbage'
    if (f.stallRate > 0 && random.next() < f.stallRate) return 'stall'
    if (f.disconnectRate > 0 && random.next() < f.disconnectRate) return 'disconnect'
    if (f.kvLoadFailureRate > 0 && random.next() < f.kvLoadFailureRate) return 'kv_load_failure'
    return 'none'
  }
}
