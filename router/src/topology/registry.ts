import type { Clock } from '../../../common/clock.js'
import type { Random } from '../../../common/random.js'
import type { InstanceConfig, InstanceRole } from '../../../schemas/router-config.js'
import { CandidateIndex, type Candidate, type Pick } from './candidates.js'
import { EngineIds, type EngineIdLimits } from './engine-ids.js'
import { selectDecoder, selectRoute, type PairingPolicy, type PickLimits, type Selection } from './selection.js'
import type { InstanceSource, InstanceView, TopologySnapshot } from './views.js'

/**
 * Health policy. `unhealthyThreshold` consecutive failed probes mark an instance down, and as
 * many consecutive connect failures of requests eject it for `baseEjectionMs`, doubling on
 * each re-ejection within `maxEjectionMs` of the last one, up to `maxEjectionMs`.
 *
 * A probe that timed out, or a request that could not connect, while the instance answered
 * other requests is not counted: the engine is busy, not gone (vLLM's /health waits behind its
 * output loop under load, seconds and more; a full accept queue drops new connections while
 * the open ones stream). Only what a dead or hung engine does counts: no answer to anything,
 * a refused connection, a /health that answers with an error.
 */
export interface HealthPolicy {
  unhealthyThreshold: number
  baseEjectionMs: number
  maxEjectionMs: number
}

/** What changed about an instance; other parts subscribe instead of polling the registry. */
export type TopologyChange =
  | { type: 'up'; instanceId: string }
  | { type: 'down'; instanceId: string }
  /** unhealthyThreshold probes in a row were refused connections: the process is not there. */
  | { type: 'refusing'; instanceId: string }
  | { type: 'ejected'; instanceId: string; forMs: number }
  /** A failed probe or connect not counted: the instance answered other requests meanwhile. */
  | { type: 'busy'; instanceId: string; check: 'probe' | 'connect' }
  | { type: 'released'; instanceId: string }
  /** Admission's limit for the instance changed (admission/adaptive-limits.ts); up: it grew. */
  | { type: 'limit'; instanceId: string; limit: number; up: boolean }
  /** A new engine_id under the same rank: the previous one is gone (engine-ids.ts). */
  | { type: 'engine_id_changed'; instanceId: string; address: string; previous: string; current: string }
  /** Another engine_id at the URL, beside the others; `sharedRanks`: this one proved that the URL fronts several engines per rank (it had been replaced, and answered again). */
  | { type: 'engine_id_learned'; instanceId: string; engineId: string; sharedRanks?: true }
  | { type: 'draining'; instanceId: string }
  | { type: 'drained'; instanceId: string }
  | { type: 'added'; instanceId: string; role: InstanceRole }
  | { type: 'removed'; instanceId: string; role: InstanceRole }

export type TopologyListener = (change: TopologyChange) => void

interface InstanceState {
  id: string
  role: InstanceRole
  source: InstanceSource
  url: string
  // Frozen once and shared by every snapshot; replaced, never mutated.
  labels: Readonly<Record<string, string>>
  kvEvents: InstanceConfig['kvEvents']
  engines: EngineIds
  /** engines.ids(), frozen once per change of the set (views share it). */
  engineIds: readonly string[]
  probedUp: boolean | undefined
  probeFailures: number
  /** Failed probes in a row that were refused connections (no process listening). */
  probeRefusals: number
  consecutiveFailures: number
  /** Answers below 500 heard from it (heads and ends), a count: a failure is excused if it moved meanwhile. */
  answers: number
  ejections: number
  ejectedUntil: number
  draining: boolean
  inflight: number
  limit: number
  models: ReadonlySet<string> | undefined
}

export interface EngineIdChange {
  instanceId: string
  address: string
  previous: string
  current: string
}

/** Eligible for new work: not probed down (unprobed counts as up), not ejected at `now`, not draining. */
function eligible(s: InstanceState, now: number): boolean {
  return s.probedUp !== false && now >= s.ejectedUntil && !s.draining
}

/**
 * The one owner of instance state. Active probes and passive request outcomes both report
 * here. Selection (`select`, `selectDecoder`) draws from candidate lists kept up to date with
 * every change (candidates.ts), and falls back to `selectRoute`, a pure function, over
 * `snapshot()`, a frozen copy, where those lists cannot answer exactly.
 *
 * Engine_ids: an instance holds the set its URL answers with (engine-ids.ts). A new
 * engine_id replaces another only under the same data-parallel rank (`<id>_dp<rank>`; no
 * suffix is rank 0): `engine_id_changed`, and the replaced one is gone. Other engine_ids
 * join the set. A replaced engine_id answering again proves the URL fronts several engines
 * per rank (pods behind one Service): from then on nothing there is replaced, and the set is
 * bounded by a cap and a TTL instead, without declaring anything gone.
 */
export class TopologyRegistry {
  readonly #clock: Clock
  readonly #policy: HealthPolicy
  readonly #instances = new Map<string, InstanceState>()
  readonly #listeners = new Set<TopologyListener>()
  readonly #pairing: PairingPolicy
  readonly #index: CandidateIndex
  /** Instances whose ejection has not expired yet: eligible again once it has, with no event. */
  readonly #ejected = new Set<InstanceState>()
  #nextThaw = Number.POSITIVE_INFINITY
  /** How many instances list each model (every instance, eligible or not). */
  readonly #models = new Map<string, number>()
  readonly #initialLimit: number
  readonly #engineIdLimits: EngineIdLimits
  readonly #engineLive: (engineId: string) => boolean
  #scans = 0
  #snapshot: TopologySnapshot | undefined

  /**
   * `limit`: requests in flight an instance starts with (admission may move it: setLimit).
   * `maxEngineIds` (default 64) and `engineIdTtlMs` (default 30 min): the bounds of an
   * instance's engine_id set (engine-ids.ts). `engineLive`: whether an engine_id is known
   * alive now (its transfer agent holds an open event stream); such an engine is never
   * replaced by another engine_id answering at its URL.
   */
  constructor(opts: {
    clock: Clock
    policy: HealthPolicy
    instances: readonly InstanceConfig[]
    pairing?: PairingPolicy
    limit?: number
    maxEngineIds?: number
    engineIdTtlMs?: number
    engineLive?: (engineId: string) => boolean
  }) {
    if (opts.policy.unhealthyThreshold < 1) throw new RangeError('unhealthyThreshold must be >= 1')
    if (opts.limit !== undefined && !(opts.limit >= 1)) throw new RangeError('limit must be >= 1')
    this.#clock = opts.clock
    this.#policy = opts.policy
    this.#initialLimit = opts.limit ?? Number.POSITIVE_INFINITY
    this.#engineIdLimits = { max: opts.maxEngineIds ?? 64, ttlMs: opts.engineIdTtlMs ?? 30 * 60_000 }
    this.#engineLive = opts.engineLive ?? (() => false)
    if (!(this.#engineIdLimits.max >= 1)) throw new RangeError('maxEngineIds must be >= 1')
    this.#pairing = opts.pairing ?? { mode: 'all', label: 'transfer_group' }
    this.#index = new CandidateIndex(this.#pairing)
    for (const cfg of opts.instances) this.#add(cfg, 'config')
  }

  /**
   * Where a request for `model` goes, with the registry's pairing policy: `selectRoute`'s
   * answer (see there), in O(pairing groups) where the candidate lists can answer exactly.
   */
  select(model: string, random: Random, limits: PickLimits = {}): Selection | undefined {
    this.#thaw()
    const pick = this.#index.pick(model, random, limits)
    if (pick === null) {
      this.#scans++
      return selectRoute(this.snapshot(), model, this.#pairing, random, limits)
    }
    return pick && this.#route(pick)
  }

  /** Picks the candidate lists could not answer, which scanned the whole topology instead. */
  get selectionScans(): number {
    return this.#scans
  }

  /** `selectDecoder`'s answer: another decoder for P's params. */
  selectDecoder(prefill: InstanceView, model: string, random: Random, limits: PickLimits = {}): InstanceView | undefined {
    this.#thaw()
    const p = this.#instances.get(prefill.id)
    const d = p ? this.#index.pickDecoder(p, model, random, limits) : null
    if (d === null) {
      this.#scans++
      return selectDecoder(this.snapshot(), prefill, model, this.#pairing, random, limits)
    }
    return d && this.#view(d as InstanceState, this.#clock.monotonic())
  }

  /** Whether instances listed their models and none lists `model` (RTR_ERR_MODEL_NOT_FOUND). */
  unknownModel(model: string): boolean {
    return this.#models.size > 0 && !this.#models.has(model)
  }

  #route(pick: Pick<Candidate>): Selection {
    const now = this.#clock.monotonic()
    if (pick.mode === 'pd') return { mode: 'pd', prefill: this.#view(pick.prefill as InstanceState, now), decode: this.#view(pick.decode as InstanceState, now) }
    if (pick.mode === 'single') return { mode: 'single', target: this.#view(pick.target as InstanceState, now) }
    return pick
  }

  /** Re-files `s` in the candidate lists after a change to anything selection reads. */
  #refile(s: InstanceState): void {
    const now = this.#clock.monotonic()
    const present = this.#instances.get(s.id) === s
    if (present && s.ejectedUntil > now) {
      this.#ejected.add(s)
      this.#nextThaw = Math.min(this.#nextThaw, s.ejectedUntil)
    } else this.#ejected.delete(s)
    if (present) this.#index.file(s, eligible(s, now))
    else this.#index.remove(s)
  }

  /** Ejections that expired since: those instances are candidates again. */
  #thaw(): void {
    const now = this.#clock.monotonic()
    if (now < this.#nextThaw) return
    this.#nextThaw = Number.POSITIVE_INFINITY
    for (const s of [...this.#ejected]) {
      if (s.ejectedUntil <= now) this.#refile(s)
      else this.#nextThaw = Math.min(this.#nextThaw, s.ejectedUntil)
    }
  }

  #setModels(s: InstanceState, models: ReadonlySet<string> | undefined): void {
    for (const m of s.models ?? []) {
      const n = (this.#models.get(m) ?? 1) - 1
      if (n === 0) this.#models.delete(m)
      else this.#models.set(m, n)
    }
    s.models = models
    for (const m of models ?? []) this.#models.set(m, (this.#models.get(m) ?? 0) + 1)
  }

  has(id: string): boolean {
    return this.#instances.has(id)
  }

  /**
   * An instance joins at runtime (the autoscaler's POST /admin/instances): unprobed, so
   * eligible at once, until its first probe says otherwise. Throws on a duplicate id.
   */
  add(cfg: InstanceConfig, source: InstanceSource = 'admin'): void {
    this.#add(cfg, source)
    this.#emit({ type: 'added', instanceId: cfg.id, role: cfg.role })
  }

  /**
   * The instance leaves the topology (drained, or deregistered by hand). Slots still held
   * for it are forgotten: releases, probes and outcomes that arrive for it later are no-ops.
   * Returns false when it was not there.
   */
  remove(id: string): boolean {
    const s = this.#instances.get(id)
    if (!s) return false
    this.#instances.delete(id)
    this.#refile(s)
    this.#setModels(s, undefined)
    this.#emit({ type: 'removed', instanceId: id, role: s.role })
    return true
  }

  #add(cfg: InstanceConfig, source: InstanceSource): void {
    if (this.#instances.has(cfg.id)) throw new Error(`duplicate instance id ${cfg.id}`)
    const s: InstanceState = {
      id: cfg.id,
      role: cfg.role,
      source,
      url: new URL(cfg.url).origin,
      labels: Object.freeze({ ...(cfg.labels ?? {}) }),
      kvEvents: cfg.kvEvents,
      engines: new EngineIds(this.#engineIdLimits),
      engineIds: Object.freeze([]),
      probedUp: undefined,
      probeFailures: 0,
      probeRefusals: 0,
      consecutiveFailures: 0,
      answers: 0,
      ejections: 0,
      ejectedUntil: 0,
      draining: false,
      inflight: 0,
      limit: this.#initialLimit,
      models: undefined,
    }
    this.#instances.set(cfg.id, s)
    this.#refile(s)
    this.#snapshot = undefined
  }

  /** Calls `listener` after every change; returns the unsubscribe function. */
  subscribe(listener: TopologyListener): () => void {
    this.#listeners.add(listener)
    return () => this.#listeners.delete(listener)
  }

  #emit(change: TopologyChange): void {
    this.#snapshot = undefined
    for (const l of this.#listeners) l(change)
  }

  get size(): number {
    return this.#instances.size
  }

  ids(): string[] {
    return [...this.#instances.keys()]
  }

  url(id: string): string {
    return this.#get(id).url
  }

  /** Work dispatched to / finished on an instance (outstanding requests, for least-loaded picks). */
  acquire(id: string): void {
    const s = this.#get(id)
    s.inflight++
    this.#refile(s)
    this.#snapshot = undefined
  }

  /** Requests in flight on the instance and its limit now; undefined when it is not there. */
  load(id: string): { inflight: number; limit: number } | undefined {
    const s = this.#instances.get(id)
    return s && { inflight: s.inflight, limit: s.limit }
  }

  /**
   * Instances holding at least `fraction` of their limit in flight: the ones whose limit is
   * worth adjusting now (admission/adaptive-limits.ts samples only those).
   */
  busy(fraction: number): string[] {
    const out: string[] = []
    for (const s of this.#instances.values()) if (s.inflight > 0 && s.inflight >= s.limit * fraction) out.push(s.id)
    return out
  }

  /** Admission's new limit for the instance: it is re-filed, and a raise wakes queued requests. */
  setLimit(id: string, limit: number): void {
    const s = this.#instances.get(id)
    if (!s || s.limit === limit) return
    if (!(limit >= 1)) throw new RangeError('limit must be >= 1')
    const up = limit > s.limit
    s.limit = limit
    this.#refile(s)
    this.#emit({ type: 'limit', instanceId: id, limit, up })
  }

  /** A slot on the instance is free again: queued requests may now be admitted. */
  release(id: string): void {
    const s = this.#instances.get(id)
    if (!s) return
    s.inflight = Math.max(0, s.inflight - 1)
    this.#refile(s)
    this.#emit({ type: 'released', instanceId: id })
    if (s.draining && s.inflight === 0) this.#emit({ type: 'drained', instanceId: id })
  }

  /**
   * A request reached the instance and got an answer (or its answer ended): the connect-failure
   * streak ends. An answer below 500 is also evidence that the engine serves (`answers`); an
   * engine that answers only errors is not excused a failed probe.
   */
  recordSuccess(id: string, status = 200): void {
    const s = this.#instances.get(id)
    if (!s) return
    s.consecutiveFailures = 0
    if (status < 500) s.answers++
  }

  /** A mark of the answers heard from the instance so far, for `recordFailure` and `recordProbe`. */
  answers(id: string): number {
    return this.#instances.get(id)?.answers ?? 0
  }

  #busy(s: InstanceState, answersBefore: number | undefined, check: 'probe' | 'connect'): boolean {
    if (answersBefore === undefined || s.answers === answersBefore) return false
    this.#emit({ type: 'busy', instanceId: s.id, check })
    return true
  }

  /**
   * A request could not connect to the instance. Only that counts here: a slow answer, a long
   * generation or an engine's error answer says nothing about the engine's health. After
   * `unhealthyThreshold` in a row the instance is ejected (outlier detection with backoff).
   * `answersBefore` (`answers(id)` when the request went out): if the instance answered others
   * since, it is busy and this failure does not count (HealthPolicy).
   */
  recordFailure(id: string, answersBefore?: number): void {
    const s = this.#instances.get(id)
    if (!s || this.#busy(s, answersBefore, 'connect')) return
    const now = this.#clock.monotonic()
    s.consecutiveFailures++
    if (s.consecutiveFailures < this.#policy.unhealthyThreshold || now < s.ejectedUntil) return
    // The backoff doubles only for re-ejections close to the previous one; later, it starts over.
    if (now - s.ejectedUntil > this.#policy.maxEjectionMs) s.ejections = 0
    const ms = Math.min(this.#policy.baseEjectionMs * 2 ** s.ejections, this.#policy.maxEjectionMs)
    s.ejections++
    s.ejectedUntil = now + ms
    s.consecutiveFailures = 0
    this.#refile(s)
    this.#emit({ type: 'ejected', instanceId: id, forMs: ms })
  }

  /**
   * An active probe's verdict. An instance that was up goes down only after
   * `unhealthyThreshold` failed probes in a row (one probe lost to a busy moment is not an
   * outage); one never seen up goes down at once. A passing probe brings it up and ends an
   * ejection: the instance serves again. Down is only out of routing: a frozen or overloaded
   * engine times out and is still alive. `refused` says the connection was refused (nothing
   * listens there); that many in a row is `refusing`, the one probe verdict that says the
   * process is gone (DESIGN "Topology": out of routing is not gone). `answersBefore`, for a
   * probe that got no answer (a timeout, a reset): `answers(id)` when it went out; if the
   * instance answered requests since, the probe is not counted (HealthPolicy).
   */
  recordProbe(id: string, up: boolean, models?: readonly string[], refused = false, answersBefore?: number): void {
    const s = this.#instances.get(id)
    if (!s || (!up && this.#busy(s, answersBefore, 'probe'))) return
    const wasEligible = eligible(s, this.#clock.monotonic())
    if (up) {
      s.probeFailures = 0
      s.probeRefusals = 0
      s.consecutiveFailures = 0
      s.ejectedUntil = 0
      if (models) this.#setModels(s, new Set(models))
      const changed = s.probedUp !== true
      s.probedUp = true
      this.#refile(s)
      this.#snapshot = undefined
      if (changed || !wasEligible) this.#emit({ type: 'up', instanceId: id })
      return
    }
    s.probeFailures++
    s.probeRefusals = refused ? s.probeRefusals + 1 : 0
    const down = s.probedUp !== false && (s.probedUp !== true || s.probeFailures >= this.#policy.unhealthyThreshold)
    if (down) {
      s.probedUp = false
      this.#refile(s)
      this.#emit({ type: 'down', instanceId: id })
    }
    // After `down`, so a listener sees it out of routing already; once per streak.
    if (s.probeRefusals === this.#policy.unhealthyThreshold) this.#emit({ type: 'refusing', instanceId: id })
  }

  /**
   * Another router's probe verdict (several routers on one store: only the prober leader
   * probes). Unlike `recordProbe`, no threshold: the leader already applied it.
   */
  applyVerdict(id: string, up: boolean, models?: readonly string[]): void {
    const s = this.#instances.get(id)
    if (!s) return
    if (models) this.#setModels(s, new Set(models))
    if (!up) {
      const wasDown = s.probedUp === false
      s.probedUp = false
      this.#refile(s)
      this.#snapshot = undefined
      if (!wasDown) this.#emit({ type: 'down', instanceId: id })
      return
    }
    const wasEligible = eligible(s, this.#clock.monotonic())
    s.probeFailures = 0
    s.ejectedUntil = 0
    const changed = s.probedUp !== true
    s.probedUp = true
    this.#refile(s)
    this.#snapshot = undefined
    if (changed || !wasEligible) this.#emit({ type: 'up', instanceId: id })
  }

  /** Whether its last unhealthyThreshold probes (or more) were all refused connections. */
  isRefusing(id: string): boolean {
    const s = this.#instances.get(id)
    return s !== undefined && s.probeRefusals >= this.#policy.unhealthyThreshold
  }

  /** Whether the instance was probed up (undefined: not probed yet), and its models. */
  verdict(id: string): { up: boolean | undefined; models: readonly string[] | undefined } | undefined {
    const s = this.#instances.get(id)
    return s && { up: s.probedUp, models: s.models && [...s.models] }
  }

  /**
   * What another router may need to rebuild this instance: its config, origin and shared
   * state. `engineIds` least recently seen first: observed in that order (after
   * markSharedRanks when `sharedRanks`), they rebuild the set elsewhere.
   */
  describe(
    id: string,
  ): (InstanceConfig & { source: InstanceSource; engineId: string | undefined; engineIds: string[]; sharedRanks: boolean; draining: boolean }) | undefined {
    const s = this.#instances.get(id)
    if (!s) return undefined
    const { engines } = s
    return { id: s.id, role: s.role, url: s.url, labels: { ...s.labels }, ...(s.kvEvents ? { kvEvents: s.kvEvents } : {}), source: s.source, engineId: engines.newest, engineIds: engines.ids(), sharedRanks: engines.sharedRanks, draining: s.draining }
  }

  /** Stop admitting new work to the instance; `drained` follows once nothing is in flight. */
  drain(id: string): void {
    const s = this.#get(id)
    if (s.draining) return
    s.draining = true
    this.#refile(s)
    this.#emit({ type: 'draining', instanceId: id })
    if (s.inflight === 0) this.#emit({ type: 'drained', instanceId: id })
  }

  needsModels(id: string): boolean {
    const s = this.#instances.get(id)
    return s !== undefined && s.models === undefined
  }

  isUp(id: string): boolean {
    const s = this.#instances.get(id)
    return s !== undefined && eligible(s, this.#clock.monotonic())
  }

  /**
   * Records an engine_id the instance answered with (a prefill answer's `remote_engine_id`),
   * into its set (engine-ids.ts). Returns the change when it replaced the engine_id of its
   * rank: that incarnation is gone (a peer_gone seam). Another engine_id of another rank, or
   * at a URL fronting several engines per rank, only joins the set.
   */
  observeEngineId(id: string, engineId: string): EngineIdChange | undefined {
    const s = this.#instances.get(id)
    if (!s) return undefined
    const seen = s.engines.observe(engineId, this.#clock.monotonic(), this.#engineLive)
    // An engine_id seen before (the request path's case) changes nothing a view shows.
    if (seen.kind === 'known' && s.engineIds.length === s.engines.size) return undefined
    s.engineIds = Object.freeze(s.engines.ids())
    this.#snapshot = undefined
    if (seen.kind !== 'replaced') {
      if (seen.kind === 'learned') this.#emit({ type: 'engine_id_learned', instanceId: id, engineId, ...(seen.sharedRanks ? { sharedRanks: true as const } : {}) })
      return undefined
    }
    const change: EngineIdChange = { instanceId: id, address: new URL(s.url).host, previous: seen.previous, current: engineId }
    this.#emit({ type: 'engine_id_changed', ...change })
    return change
  }

  /** Another router found the URL to front several engines per rank (shared topology): nothing is replaced here either. */
  markSharedRanks(id: string): void {
    const s = this.#instances.get(id)
    if (s?.engines.markSharedRanks()) this.#snapshot = undefined
  }

  snapshot(): TopologySnapshot {
    // Ejections expire with time, so a cached snapshot is only reused within one millisecond tick.
    if (this.#snapshot) return this.#snapshot
    const now = this.#clock.monotonic()
    const models = new Set<string>()
    const instances: InstanceView[] = []
    for (const s of this.#instances.values()) {
      if (s.models) for (const m of s.models) models.add(m)
      instances.push(this.#view(s, now))
    }
    const snap: TopologySnapshot = Object.freeze({ instances: Object.freeze(instances), models })
    // Cache only while no ejection is pending expiry; otherwise rebuild each time.
    const pending = [...this.#instances.values()].some((s) => s.ejectedUntil > now)
    if (!pending) this.#snapshot = snap
    return snap
  }

  #view(s: InstanceState, now: number): InstanceView {
    return Object.freeze({
      id: s.id,
      role: s.role,
      source: s.source,
      url: s.url,
      labels: s.labels,
      engineIds: s.engineIds,
      engineId: s.engines.newest,
      sharedRanks: s.engines.sharedRanks,
      healthy: eligible(s, now),
      draining: s.draining,
      inflight: s.inflight,
      limit: s.limit,
      models: s.models,
    })
  }

  #get(id: string): InstanceState {
    const s = this.#instances.get(id)
    if (!s) throw new Error(`unknown instance ${id}`)
    return s
  }
}
