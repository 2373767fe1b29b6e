import { BoundedSet } from '../events/bounded-set.js'

/**
 * The engine_ids one instance's URL answers with (DESIGN "Topology and liveness", issue 37
 * item 3). One URL may front several live engines: vLLM data parallel names each rank's engine
 * `<engine_id>_dp<rank>` behind one API server (vLLM 0.32 v1/engine/core.py), and a Service or
 * load balancer fronts several pods. Another engine_id answering there is not a death.
 *
 * The rule:
 * - An engine_id's rank is N for `<base>_dp<N>`, 0 without the suffix (vLLM adds it only with
 *   data parallel on; one engine is rank 0).
 * - A new engine_id replaces the one of its rank (that one is gone: its process restarted
 *   under a new engine_id), unless the URL proved to front several engines of one rank.
 * - The proof: the one it would replace is known alive (its transfer agent holds an open event
 *   stream; an engine that restarts has its agent register the new engine_id first, or a new
 *   agent replace the old one), or an engine_id that was replaced answers again here. Either
 *   way it was alive all along (two pods without a rank suffix behind one Service look like one
 *   engine restarting to a router that hears neither), so from then on nothing at this URL is
 *   replaced: its engine_ids are gone only when known gone otherwise (a crash, ops, a drain or
 *   removal, an agent's word).
 * - Bounded without declaring anything gone: at most `max` engine_ids (the least recently
 *   seen forgotten first), and where nothing replaces (a URL over several engines per rank)
 *   those not seen for `ttlMs` are forgotten too, never the last one that answered. Ranks are
 *   not forgotten by time: their replacement keeps the set small, and an idle rank must still
 *   be replaced when it restarts.
 */
export interface EngineIdLimits {
  max: number
  ttlMs: number
}

/** What one answer's engine_id did to the set. */
export type Observed = { kind: 'known' } | { kind: 'learned'; sharedRanks: boolean } | { kind: 'replaced'; previous: string }

const DP_SUFFIX = /_dp(\d+)$/

/** The data-parallel rank an engine_id names (vLLM's `_dp<rank>` suffix); 0 without one. */
export function rankOf(engineId: string): number {
  const m = DP_SUFFIX.exec(engineId)
  return m ? Number(m[1]) : 0
}

/** Replaced engine_ids remembered per instance, to notice one answering again. */
const REPLACED_KEPT = 16

export class EngineIds {
  readonly #limits: EngineIdLimits
  /** engine_id → when it last answered (monotonic ms); least recently seen first. */
  readonly #seen = new Map<string, number>()
  readonly #replaced = new BoundedSet<string>(REPLACED_KEPT)
  #shared = false
  #newest: string | undefined
  #expiredAt = Number.NEGATIVE_INFINITY

  constructor(limits: EngineIdLimits) {
    this.#limits = limits
  }

  /** Every engine_id held, least recently seen first. */
  ids(): string[] {
    return [...this.#seen.keys()]
  }

  get size(): number {
    return this.#seen.size
  }

  /** The engine_id added last (undefined before the first answer). */
  get newest(): string | undefined {
    return this.#newest
  }

  /** Whether the URL proved to front several engines of one rank (nothing is replaced there). */
  get sharedRanks(): boolean {
    return this.#shared
  }

  /** Another router found it so (shared topology). Returns whether it changed. */
  markSharedRanks(): boolean {
    const changed = !this.#shared
    this.#shared = true
    return changed
  }

  /** An answer named `engineId` at `now`; `live` says whether an engine_id is known alive now. */
  observe(engineId: string, now: number, live: (engineId: string) => boolean = () => false): Observed {
    if (this.#shared) this.#expire(now)
    if (this.#seen.has(engineId)) {
      this.#touch(engineId, now)
      return { kind: 'known' }
    }
    let previous: string | undefined
    let sharedRanks = false
    if (this.#replaced.delete(engineId)) sharedRanks = this.markSharedRanks()
    else if (!this.#shared) previous = this.ids().find((e) => rankOf(e) === rankOf(engineId))
    if (previous !== undefined && live(previous)) {
      sharedRanks = this.markSharedRanks()
      previous = undefined
    }
    if (previous !== undefined) {
      this.#seen.delete(previous)
      this.#replaced.add(previous)
    }
    this.#touch(engineId, now)
    this.#newest = engineId
    while (this.#seen.size > this.#limits.max) this.#forget(this.#seen.keys().next().value as string)
    return previous !== undefined ? { kind: 'replaced', previous } : { kind: 'learned', sharedRanks }
  }

  #touch(engineId: string, now: number): void {
    this.#seen.delete(engineId)
    this.#seen.set(engineId, now)
  }

  #forget(engineId: string): void {
    this.#seen.delete(engineId)
    if (this.#newest === engineId) this.#newest = this.ids().at(-1)
  }

  /** Forgets those not seen for ttlMs but the last one seen; at most once a second. */
  #expire(now: number): void {
    if (now - this.#expiredAt < 1000) return
    this.#expiredAt = now
    const last = this.ids().at(-1)
    for (const [id, at] of this.#seen) if (id !== last && now - at > this.#limits.ttlMs) this.#forget(id)
  }
}
