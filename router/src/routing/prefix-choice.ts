/*
 * Prefix-aware choice of one leg's instance (issue 39 part 3; docs/routing.md). Pure: the
 * candidate lists and the prefix index stay where they are, this only weighs them.
 *
 * A candidate's cost stands for the time to the first token, in prompts' worth of work:
 *   cost = (1 − cached ÷ prompt tokens) + loadWeight × in flight
 * P must still prefill what it does not hold; D must still pull (over NIXL) what it does not
 * hold. The load pick (power of two choices, as without an index) always competes, so a
 * prompt that no candidate holds goes where load alone sends it (misses spread; no hot spot),
 * and a holder wins only while what it saves outweighs its queue. A holder past the load
 * guard (more in flight than `ratio` × its side's mean + `slack`) is never chosen for its cache.
 */

export interface LegWeights {
  loadWeight: number
}

export interface LoadGuard {
  ratio: number
  slack: number
}

/** What a prompt's prefix index lookup offers a pick (routing/prefix-routing.ts builds it). */
export interface PrefixPreference {
  /** The prompt's length in tokens, as the engine tokenizes it. */
  readonly tokens: number
  /** Instances the index holds blocks for: the only candidates that can hold any of it. */
  holders(): Iterable<string>
  /** Leading tokens of the prompt the instance holds (0: none). */
  cached(instanceId: string): number
  readonly prefill: LegWeights
  readonly decode: LegWeights
  readonly guard: LoadGuard
  /**
   * Whether a decoder holding `cachedTokens` of the prompt serves it alone, with no P leg:
   * `held` (all but a few tokens are there), `short` (the prompt is short), or undefined.
   */
  alone(cachedTokens: number): AloneReason | undefined
  /** Told each leg's decision, for metrics and the access log. */
  chose(leg: Leg, reason: ChoiceReason, cachedTokens: number): void
  /** Told that the request goes to a decoder alone, and why. */
  wentAlone(reason: AloneReason): void
}

/** Why a request went to a decoder alone (decode-only). */
export type AloneReason = 'held' | 'short'

/** `single`: one instance prefills and decodes (no prefiller): weighed as a prefill. */
export type Leg = 'prefill' | 'decode' | 'single'
/** `prefix`: a holder won on cost; `load`: the load pick won over holders; `cold`: no candidate held any of it. */
export type ChoiceReason = 'prefix' | 'load' | 'cold'

interface Loaded {
  readonly id: string
  readonly inflight: number
}

/**
 * The instance for one leg: `loadPick` (the power-of-two pick) or a cheaper holder.
 * `candidate(id)` is the holder as an open candidate of this leg (undefined when it is not one:
 * wrong side, another pairing group, at its limit, excluded); `meanInflight` is the side's mean.
 */
export function preferCached<T extends Loaded>(
  leg: Leg,
  loadPick: T,
  candidate: (id: string) => T | undefined,
  meanInflight: number,
  prefix: PrefixPreference,
): T {
  const weights = prefix[leg === 'single' ? 'prefill' : leg]
  const bound = meanInflight * prefix.guard.ratio + prefix.guard.slack
  const cost = (c: T, cached: number): number => (prefix.tokens > 0 ? 1 - cached / prefix.tokens : 1) + weights.loadWeight * c.inflight
  let best = loadPick
  let bestCached = prefix.cached(loadPick.id)
  let bestCost = cost(loadPick, bestCached)
  let held = bestCached > 0
  for (const id of prefix.holders()) {
    if (id === loadPick.id) continue
    const c = candidate(id)
    if (c === undefined || c.inflight > bound) continue
    const cached = prefix.cached(id)
    if (cached === 0) continue
    held = true
    const k = cost(c, cached)
    if (k < bestCost) {
      best = c
      bestCost = k
      bestCached = cached
    }
  }
  prefix.chose(leg, best !== loadPick ? 'prefix' : held ? (bestCached > 0 ? 'prefix' : 'load') : 'cold', bestCached)
  return best
}

/**
 * Decode-only (docs/routing.md): the decoder with room that holds the most of the prompt, when
 * it may serve it alone (PrefixPreference.alone) and is within the load guard; else undefined.
 * Counted as that decoder's choice (leg `single`).
 */
export function decodeAlone<T extends Loaded>(candidate: (id: string) => T | undefined, meanInflight: number, prefix: PrefixPreference): T | undefined {
  if (prefix.alone(0) === 'short') return undefined
  const bound = meanInflight * prefix.guard.ratio + prefix.guard.slack
  let best: T | undefined
  let bestCached = 0
  for (const id of prefix.holders()) {
    const c = candidate(id)
    if (c === undefined || c.inflight > bound) continue
    const cached = prefix.cached(id)
    if (cached > bestCached || (cached === bestCached && best !== undefined && c.inflight < best.inflight)) {
      best = c
      bestCached = cached
    }
  }
  if (best === undefined || prefix.alone(bestCached) === undefined) return undefined
  prefix.chose('single', 'prefix', bestCached)
  prefix.wentAlone('held')
  return best
}
