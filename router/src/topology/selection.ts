import type { Random } from '../../../common/random.js'
import type { InstanceView, TopologySnapshot } from './registry.js'

export interface PairingPolicy {
  mode: 'all' | 'label'
  label: string
}

/** Where one request goes: a prefill/decode pair, or one instance that does both. */
export type Route =
  | { mode: 'pd'; prefill: InstanceView; decode: InstanceView }
  | { mode: 'single'; target: InstanceView }

function serves(inst: InstanceView, model: string): boolean {
  // Models not read yet: assume it can, the engine will say otherwise.
  return inst.healthy && (inst.models === undefined || inst.models.has(model))
}

/** Whether decoder `d` may read KV from prefiller `p` under the pairing policy. */
export function paired(p: InstanceView, d: InstanceView, policy: PairingPolicy): boolean {
  if (policy.mode === 'all') return true
  return (p.labels[policy.label] ?? '') === (d.labels[policy.label] ?? '')
}

/** Power of two choices on outstanding work: two random candidates, the less loaded wins. */
export function pickLeastLoaded(candidates: readonly InstanceView[], random: Random): InstanceView | undefined {
  if (candidates.length <= 1) return candidates[0]
  const i = Math.floor(random.next() * candidates.length)
  let j = Math.floor(random.next() * (candidates.length - 1))
  if (j >= i) j++
  const a = candidates[i] as InstanceView
  const b = candidates[j] as InstanceView
  return b.inflight < a.inflight ? b : a
}

/**
 * Chooses where a request for `model` goes. Pure: same snapshot and random draws, same
 * answer. Prefers a P/D pair; with no healthy prefiller (or none paired with a healthy
 * decoder) it falls back to one instance that prefills locally.
 */
export function selectRoute(
  snapshot: TopologySnapshot,
  model: string,
  pairing: PairingPolicy,
  random: Random,
): Route | undefined {
  const decoders = snapshot.instances.filter((i) => i.role !== 'prefill' && serves(i, model))
  const prefillers = snapshot.instances.filter(
    (p) => p.role === 'prefill' && serves(p, model) && decoders.some((d) => paired(p, d, pairing)),
  )
  const prefill = pickLeastLoaded(prefillers, random)
  if (prefill) {
    const decode = pickLeastLoaded(
      decoders.filter((d) => paired(prefill, d, pairing)),
      random,
    )
    if (decode) return { mode: 'pd', prefill, decode }
  }
  const target = pickLeastLoaded(decoders, random)
  return target ? { mode: 'single', target } : undefined
}
