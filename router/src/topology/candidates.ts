import type { Random } from '../../../common/random.js'
import type { InstanceRole } from '../../../schemas/router-config.js'
import { decodeAlone, preferCached, type PrefixPreference } from '../routing/prefix-choice.js'
import { pickLeastLoaded, type PairingPolicy, type PickLimits } from './selection.js'

/** What the index reads of an instance: the registry's own live record. */
export interface Candidate {
  readonly id: string
  readonly role: InstanceRole
  readonly labels: Readonly<Record<string, string>>
  readonly inflight: number
  /** Requests it may have in flight now (admission's limit for it). */
  readonly limit: number
  readonly models: ReadonlySet<string> | undefined
}

/** A pick from the index: live records, which the registry turns into views. */
export type Pick<T> = { mode: 'pd'; prefill: T; decode: T } | { mode: 'single'; target: T } | { mode: 'full'; of: 'pd' | 'single' }

/** A set with O(1) add, delete and i-th element (delete swaps the last one in). */
class Bucket {
  readonly items: Candidate[] = []
  readonly #pos = new Map<string, number>()

  get size(): number {
    return this.items.length
  }

  add(c: Candidate): void {
    this.#pos.set(c.id, this.items.length)
    this.items.push(c)
  }

  delete(c: Candidate): void {
    const i = this.#pos.get(c.id)
    if (i === undefined) return
    this.#pos.delete(c.id)
    const last = this.items.pop() as Candidate
    if (last !== c) {
      this.items[i] = last
      this.#pos.set(last.id, i)
    }
  }
}

/** One side (prefillers, or instances that decode) of one pairing group: with a free slot, or at its limit. */
interface Side {
  open: Bucket
  full: Bucket
}

/** Instances that may pair with each other: all of them, or those sharing the pairing label's value. */
interface Group {
  p: Side
  d: Side
}

/** Where an instance is filed: nowhere (not eligible), or a group's side, open or full. */
interface Filed {
  candidate: Candidate
  /** Its inflight when filed: the side's sum moves by the difference (a leg's mean, for the load guard). */
  inflight: number
  group: Group
  key: string
  side: 'p' | 'd'
  open: boolean
  models: ReadonlySet<string> | undefined
}

const side = (): Side => ({ open: new Bucket(), full: new Bucket() })
const count = (s: Side): number => s.open.size + s.full.size

/**
 * Candidate lists for selection at scale (issue 23 item 3). `selectRoute` filters the whole
 * topology on every pick, and the registry rebuilds its snapshot after every slot taken or
 * given back, so a pick cost O(instances): 0.1-0.3 ms at 1,000. Here every eligible instance
 * (up, not ejected, not draining) is filed in its pairing group, as a prefiller or a decoder
 * (role decode or both), in an `open` list (below its limit) or a `full` one; the registry
 * re-files an instance when anything selection reads changes, in O(1). A pick then draws its
 * power-of-two candidates from the open lists, O(groups).
 *
 * The index answers only where it can answer exactly as `selectRoute` would: no exclusions (a retry), no pair resting after KV-load failures, and every
 * eligible instance serving the model (or not known yet to serve none). Otherwise `pick`
 * answers null and the caller falls back to `selectRoute` over a snapshot: those cases are
 * rare and short-lived, and their rules stay in one place.
 */
export class CandidateIndex {
  readonly #pairing: PairingPolicy
  readonly #groups = new Map<string, Group>()
  readonly #filed = new Map<string, Filed>()
  /** Groups with at least one eligible prefiller and one eligible decoder. */
  readonly #paired = new Set<Group>()
  /** Eligible instances that list each model; `#unknown` list none yet (assumed to serve any). */
  readonly #serving = new Map<string, number>()
  #unknown = 0
  #eligible = 0
  #decoders = 0
  /** In flight on the eligible prefillers and decoders, for the load guard's means. */
  readonly #inflight = { p: 0, d: 0 }

  constructor(pairing: PairingPolicy) {
    this.#pairing = pairing
  }

  /** Files `c` where it belongs now: call after any change to its eligibility, inflight, limit or models. */
  file(c: Candidate, eligible: boolean): void {
    const was = this.#filed.get(c.id)
    if (!eligible) {
      if (was) this.#unfile(c, was)
      return
    }
    const key = this.#pairing.mode === 'all' ? '' : (c.labels[this.#pairing.label] ?? '')
    const s = c.role === 'prefill' ? 'p' : 'd'
    const open = c.inflight < c.limit
    if (was && was.key === key && was.side === s && was.models === c.models) {
      this.#inflight[s] += c.inflight - was.inflight
      was.inflight = c.inflight
      if (was.open === open) return
      const bucket = was.group[s]
      ;(was.open ? bucket.open : bucket.full).delete(c)
      ;(open ? bucket.open : bucket.full).add(c)
      was.open = open
      return
    }
    if (was) this.#unfile(c, was)
    let group = this.#groups.get(key)
    if (!group) {
      group = { p: side(), d: side() }
      this.#groups.set(key, group)
    }
    ;(open ? group[s].open : group[s].full).add(c)
    this.#filed.set(c.id, { candidate: c, inflight: c.inflight, group, key, side: s, open, models: c.models })
    this.#inflight[s] += c.inflight
    this.#eligible++
    if (s === 'd') this.#decoders++
    this.#countModels(c.models, 1)
    this.#pairedChanged(group)
  }

  /** Forgets `c` (it left the topology). */
  remove(c: Candidate): void {
    const was = this.#filed.get(c.id)
    if (was) this.#unfile(c, was)
  }

  /**
   * `selectRoute`'s answer drawn from the lists: a route, `full`, or undefined (no route at
   * all); null when the index cannot answer this one exactly (see the class comment).
   */
  pick(model: string, random: Random, limits: PickLimits): Pick<Candidate> | undefined | null {
    if (!this.#exact(model, limits)) return null
    if (this.#paired.size > 0) {
      const groups: Group[] = []
      let open = 0
      for (const g of this.#paired) {
        if (g.p.open.size === 0 || g.d.open.size === 0) continue
        groups.push(g)
        open += g.p.open.size
      }
      if (open === 0) return { mode: 'full', of: 'pd' }
      const alone = limits.prefix && this.#alone(groups, random, limits.prefix)
      if (alone) return { mode: 'single', target: alone }
      let prefill = this.#leastLoadedOf(groups, open, 'p', random)
      if (limits.prefix) {
        // A prefiller with room whose group has a decoder with room.
        const usable = this.#openOn('p', (g) => g.d.open.size > 0 && this.#paired.has(g))
        prefill = preferCached('prefill', prefill, usable, this.#mean('p'), limits.prefix)
      }
      return { mode: 'pd', prefill, decode: this.#decoderFor(prefill, random, limits) as Candidate }
    }
    if (this.#decoders === 0) return undefined
    const groups: Group[] = []
    let open = 0
    for (const g of this.#groups.values()) {
      if (g.d.open.size === 0) continue
      groups.push(g)
      open += g.d.open.size
    }
    if (open === 0) return { mode: 'full', of: 'single' }
    const target = this.#leastLoadedOf(groups, open, 'd', random)
    if (!limits.prefix) return { mode: 'single', target }
    return { mode: 'single', target: preferCached('single', target, this.#openOn('d'), this.#mean('d'), limits.prefix) }
  }

  /** `selectDecoder`'s answer for `prefill` (a filed prefiller), or null when not exact. */
  pickDecoder(prefill: Candidate, model: string, random: Random, limits: PickLimits): Candidate | undefined | null {
    const filed = this.#filed.get(prefill.id)
    if (!filed || filed.side !== 'p' || !this.#exact(model, limits)) return null
    return this.#decoderFor(prefill, random, limits)
  }

  /** A decoder of `prefill`'s group with room: the load pick, or a cheaper holder of the prompt. */
  #decoderFor(prefill: Candidate, random: Random, limits: PickLimits): Candidate | undefined {
    const group = (this.#filed.get(prefill.id) as Filed).group
    const decode = pickLeastLoaded(this.#two(group.d.open, random), random)
    if (!decode || !limits.prefix) return decode
    return preferCached('decode', decode, this.#openOn('d', (g) => g === group), this.#mean('d'), limits.prefix)
  }

  /** Decode-only (routing/prefix-choice.ts): a decoder with room that serves the prompt alone, if any. */
  #alone(groups: readonly Group[], random: Random, prefix: PrefixPreference): Candidate | undefined {
    const decoder = this.#openOn('d')
    const held = decodeAlone(decoder, this.#mean('d'), prefix)
    if (held || prefix.alone(0) !== 'short') return held
    let open = 0
    for (const g of groups) open += g.d.open.size
    prefix.wentAlone('short')
    return preferCached('single', this.#leastLoadedOf(groups, open, 'd', random), decoder, this.#mean('d'), prefix)
  }

  /** Looks up an id as a candidate with room on side `s` (in a group `inGroup` accepts), for the prefix choice. */
  #openOn(s: 'p' | 'd', inGroup: (g: Group) => boolean = () => true): (id: string) => Candidate | undefined {
    return (id) => {
      const f = this.#filed.get(id)
      return f && f.side === s && f.open && inGroup(f.group) ? f.candidate : undefined
    }
  }

  /** Mean in flight on one side's eligible instances. */
  #mean(s: 'p' | 'd'): number {
    const n = s === 'd' ? this.#decoders : this.#eligible - this.#decoders
    return n > 0 ? this.#inflight[s] / n : 0
  }

  #exact(model: string, limits: PickLimits): boolean {
    return (
      (limits.exclude === undefined || limits.exclude.size === 0) &&
      limits.blocked === undefined &&
      (this.#serving.get(model) ?? 0) + this.#unknown === this.#eligible
    )
  }

  /** Power of two choices over the open lists of `groups` (holding `open` candidates in all). */
  #leastLoadedOf(groups: readonly Group[], open: number, s: 'p' | 'd', random: Random): Candidate {
    if (open === 1) return this.#nth(groups, 0, s)
    const i = Math.floor(random.next() * open)
    let j = Math.floor(random.next() * (open - 1))
    if (j >= i) j++
    const a = this.#nth(groups, i, s)
    const b = this.#nth(groups, j, s)
    return b.inflight < a.inflight ? b : a
  }

  #nth(groups: readonly Group[], n: number, s: 'p' | 'd'): Candidate {
    for (const g of groups) {
      const items = g[s].open.items
      if (n < items.length) return items[n] as Candidate
      n -= items.length
    }
    throw new Error('candidate index: draw out of range')
  }

  /** Two distinct members of `b` at random (all of it when it has two or fewer). */
  #two(b: Bucket, random: Random): Candidate[] {
    if (b.size <= 2) return b.items
    const i = Math.floor(random.next() * b.size)
    let j = Math.floor(random.next() * (b.size - 1))
    if (j >= i) j++
    return [b.items[i] as Candidate, b.items[j] as Candidate]
  }

  #unfile(c: Candidate, was: Filed): void {
    const bucket = was.group[was.side]
    ;(was.open ? bucket.open : bucket.full).delete(c)
    this.#filed.delete(c.id)
    this.#inflight[was.side] -= was.inflight
    this.#eligible--
    if (was.side === 'd') this.#decoders--
    this.#countModels(was.models, -1)
    this.#pairedChanged(was.group)
    if (count(was.group.p) === 0 && count(was.group.d) === 0) this.#groups.delete(was.key)
  }

  #countModels(models: ReadonlySet<string> | undefined, by: 1 | -1): void {
    if (!models) {
      this.#unknown += by
      return
    }
    for (const m of models) {
      const n = (this.#serving.get(m) ?? 0) + by
      if (n === 0) this.#serving.delete(m)
      else this.#serving.set(m, n)
    }
  }

  #pairedChanged(g: Group): void {
    if (count(g.p) > 0 && count(g.d) > 0) this.#paired.add(g)
    else this.#paired.delete(g)
  }
}
