import type { Random } from '../../../common/random.js'
import { decodeAlone, preferCached, type Leg, type PrefixPreference } from '../routing/prefix-choice.js'
import type { InstanceView, TopologySnapshot } from './views.js'

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
export function pickLeastLoaded<T extends { readonly inflight: number }>(candidates: readonly T[], random: Random): T | undefined {
  if (candidates.length <= 1) return candidates[0]
  const i = Math.floor(random.next() * candidates.length)
  let j = Math.floor(random.next() * (candidates.length - 1))
  if (j >= i) j++
  const a = candidates[i] as T
  const b = candidates[j] as T
  return b.inflight < a.inflight ? b : a
}

/** Limits on a pick: instances to skip (a failed retry). Each instance's own `limit` caps its work. */
export interface PickLimits {
  exclude?: ReadonlySet<string>
  /** Pairs resting after KV-load failures (pair-breakers.ts): one more pairing filter. */
  blocked?: (prefill: string, decode: string) => boolean
  /** The prompt's prefix index lookup: a holder may win over the load pick (routing/prefix-choice.ts). */
  prefix?: PrefixPreference
}

/** `pick`, or a cheaper holder of the prompt among `open` when the limits carry a prefix lookup. */
function preferred<T extends InstanceView>(leg: Leg, pick: T | undefined, open: readonly T[], all: readonly T[], prefix: PrefixPreference | undefined): T | undefined {
  if (!pick || !prefix) return pick
  const byId = new Map(open.map((i) => [i.id, i]))
  const mean = all.reduce((n, i) => n + i.inflight, 0) / all.length
  return preferCached(leg, pick, (id) => byId.get(id), mean, prefix)
}

/** A route, or `full`: a healthy route exists but every candidate is at its limit (queue). */
export type Selection = Route | { mode: 'full'; of: Route['mode'] }

const NO_LIMITS: PickLimits = {}

/** Decode-only among `decoders` with room (routing/prefix-choice.ts), if the prompt may go to one alone. */
function aloneOn(decoders: readonly InstanceView[], room: (i: InstanceView) => boolean, random: Random, prefix: PrefixPreference | undefined): InstanceView | undefined {
  if (!prefix) return undefined
  const free = decoders.filter(room)
  const byId = new Map(free.map((i) => [i.id, i]))
  const mean = decoders.reduce((n, i) => n + i.inflight, 0) / decoders.length
  const held = decodeAlone((id) => byId.get(id), mean, prefix)
  if (held || prefix.alone(0) !== 'short') return held
  prefix.wentAlone('short')
  return preferred('single', pickLeastLoaded(free, random), free, decoders, prefix)
}

/**
 * Chooses where a request for `model` goes. Pure: same snapshot and random draws, same
 * answer. The mode is decided by health alone: a P/D pair when a healthy prefiller is paired
 * with a healthy decoder, else one instance that prefills locally. Capacity then picks among
 * those; when all are at their limit the answer is `full`, never a fallback to another mode.
 * The one exception is the prompt's own (`limits.prefix`): a P/D route may go decode-only, to
 * a decoder that holds nearly all of the prompt (routing/prefix-choice.ts).
 */
export function selectRoute(
  snapshot: TopologySnapshot,
  model: string,
  pairing: PairingPolicy,
  random: Random,
  limits: PickLimits = NO_LIMITS,
): Selection | undefined {
  const usable = (i: InstanceView): boolean => serves(i, model) && !limits.exclude?.has(i.id)
  const room = (i: InstanceView): boolean => i.inflight < i.limit
  const pairs = (p: InstanceView, d: InstanceView): boolean => paired(p, d, pairing) && !limits.blocked?.(p.id, d.id)
  const decoders = snapshot.instances.filter((i) => i.role !== 'prefill' && usable(i))
  const prefillers = snapshot.instances.filter((p) => p.role === 'prefill' && usable(p) && decoders.some((d) => pairs(p, d)))
  if (prefillers.length > 0) {
    const open = prefillers.filter((p) => room(p) && decoders.some((d) => room(d) && pairs(p, d)))
    const alone = open.length > 0 ? aloneOn(decoders, room, random, limits.prefix) : undefined
    if (alone) return { mode: 'single', target: alone }
    const prefill = preferred('prefill', pickLeastLoaded(open, random), open, prefillers, limits.prefix)
    if (!prefill) return { mode: 'full', of: 'pd' }
    const its = decoders.filter((d) => room(d) && pairs(prefill, d))
    const decode = preferred('decode', pickLeastLoaded(its, random), its, decoders, limits.prefix) as InstanceView
    return { mode: 'pd', prefill, decode }
  }
  if (decoders.length === 0) return undefined
  const free = decoders.filter(room)
  const target = preferred('single', pickLeastLoaded(free, random), free, decoders, limits.prefix)
  return target ? { mode: 'single', target } : { mode: 'full', of: 'single' }
}

/** Another decoder for P's params after `failed` refused the connection (never saw them). */
export function selectDecoder(
  snapshot: TopologySnapshot,
  prefill: InstanceView,
  model: string,
  pairing: PairingPolicy,
  random: Random,
  limits: PickLimits,
): InstanceView | undefined {
  const candidates = snapshot.instances.filter(
    (d) =>
      d.role !== 'prefill' &&
      serves(d, model) &&
      !limits.exclude?.has(d.id) &&
      d.inflight < d.limit &&
      paired(prefill, d, pairing) &&
      !limits.blocked?.(prefill.id, d.id),
  )
  const all = snapshot.instances.filter((d) => d.role !== 'prefill' && serves(d, model))
  return preferred('decode', pickLeastLoaded(candidates, random), candidates, all, limits.prefix)
}
