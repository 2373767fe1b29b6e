import type { Counter } from 'prom-client'
import type { Random } from '../../../common/random.js'
import type { RouterConfig } from '../../../schemas/router-config.js'
import type { TopologyRegistry } from '../topology/registry.js'
import type { AloneReason, ChoiceReason, Leg, PrefixPreference } from './prefix-choice.js'
import type { PrefixIndex } from './prefix-index.js'
import { tokenizeInput, type PromptTokens } from './prompt-tokens.js'

/*
 * One request's prefix lookup (issue 39 part 3; docs/routing.md): its token ids from an
 * engine, its blocks hashed once on the router's seed, and what each instance holds of them,
 * handed to selection as a PrefixPreference. Only when it can matter: policy `prefix` and an
 * index holding blocks of some engine; otherwise the request costs nothing extra.
 */

export interface PrefixRoutingMetrics {
  choices: Counter<'leg' | 'reason'>
  cachedTokens: Counter<'leg'>
  decodeOnly: Counter<'reason'>
}

export interface PrefixRoutingOptions {
  config: RouterConfig['routing']
  index: PrefixIndex
  tokens: PromptTokens
  registry: TopologyRegistry
  random: Random
  metrics?: PrefixRoutingMetrics
}

/** What the access log says of a request's prefix-aware choices. */
export interface RoutingNote {
  tokens: number
  legs: Partial<Record<Leg, { reason: ChoiceReason; cachedTokens: number }>>
  /** Sent to a decoder alone (decode-only), and why. */
  alone?: AloneReason
}

export class PrefixRouting {
  readonly #o: PrefixRoutingOptions

  constructor(o: PrefixRoutingOptions) {
    this.#o = o
  }

  /**
   * The prompt's preference for selection, or undefined (routed on load alone). `note` gets
   * each leg's choice as selection makes it.
   */
  async preference(chat: boolean, get: (key: string) => unknown, signal: AbortSignal, note: RoutingNote): Promise<PrefixPreference | undefined> {
    const { config, index, registry, random, metrics } = this.#o
    if (config.policy !== 'prefix' || !index.holdsAny()) return undefined
    const model = get('model')
    if (typeof model !== 'string') return undefined
    // The engine that would serve it tokenizes it (any engine of the model tokenizes alike).
    const route = registry.select(model, random)
    const asked = route?.mode === 'pd' ? route.prefill : route?.mode === 'single' ? route.target : undefined
    if (!asked) return undefined
    const tokens = await this.#o.tokens.of(tokenizeInput(chat, get), asked.url, signal)
    if (!tokens) return undefined
    const prompt = index.prompt(tokens)
    note.tokens = tokens.length
    return {
      tokens: tokens.length,
      holders: () => index.engines(),
      cached: (id) => index.cachedTokens(id, prompt),
      prefill: config.prefill,
      decode: config.decode,
      guard: config.loadGuard,
      alone(cachedTokens) {
        const { maxUncachedTokens, maxPromptTokens } = config.decodeOnly
        if (maxPromptTokens > 0 && tokens.length <= maxPromptTokens) return 'short'
        return maxUncachedTokens > 0 && cachedTokens > 0 && tokens.length - cachedTokens <= maxUncachedTokens ? 'held' : undefined
      },
      chose(leg, reason, cachedTokens) {
        note.legs[leg] = { reason, cachedTokens }
        metrics?.choices.inc({ leg, reason })
        if (cachedTokens > 0) metrics?.cachedTokens.inc({ leg }, cachedTokens)
      },
      wentAlone(reason) {
        note.alone = reason
        metrics?.decodeOnly.inc({ reason })
      },
    }
  }
}
