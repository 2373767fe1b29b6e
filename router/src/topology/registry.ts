import type { Clock } from '../../../common/clock.js'
import type { InstanceConfig, InstanceRole } from '../../../schemas/router-config.js'

/** Health policy: how many failures eject an instance and for how long. */
export interface HealthPolicy {
  unhealthyThreshold: number
  baseEjectionMs: number
  maxEjectionMs: number
}

/** An immutable view of one instance, as selection sees it. */
export interface InstanceView {
  readonly id: string
  readonly role: InstanceRole
  readonly url: string
  readonly labels: Readonly<Record<string, string>>
  readonly engineId: string | undefined
  /** Eligible for new work: probed up (or not yet probed) and not ejected. */
  readonly healthy: boolean
  readonly inflight: number
  /** Models the instance serves; undefined until its /v1/models was read. */
  readonly models: ReadonlySet<string> | undefined
}

export interface TopologySnapshot {
  readonly instances: readonly InstanceView[]
  /** Union of every instance's models. */
  readonly models: ReadonlySet<string>
}

interface InstanceState {
  id: string
  role: InstanceRole
  url: string
  // Frozen once and shared by every snapshot; replaced, never mutated.
  labels: Readonly<Record<string, string>>
  engineId: string | undefined
  probedUp: boolean | undefined
  consecutiveFailures: number
  ejections: number
  ejectedUntil: number
  inflight: number
  models: ReadonlySet<string> | undefined
}

export interface EngineIdChange {
  instanceId: string
  address: string
  previous: string
  current: string
}

/** Eligible for new work: not probed down (unprobed counts as up) and not ejected at `now`. */
function eligible(s: InstanceState, now: number): boolean {
  return s.probedUp !== false && now >= s.ejectedUntil
}

/**
 * The one owner of instance state. Active probes and passive request outcomes both report
 * here; selection works on `snapshot()`, a frozen copy, so it stays a pure function.
 */
export class TopologyRegistry {
  readonly #clock: Clock
  readonly #policy: HealthPolicy
  readonly #instances = new Map<string, InstanceState>()
  #snapshot: TopologySnapshot | undefined

  constructor(opts: { clock: Clock; policy: HealthPolicy; instances: readonly InstanceConfig[] }) {
    if (opts.policy.unhealthyThreshold < 1) throw new RangeError('unhealthyThreshold must be >= 1')
    this.#clock = opts.clock
    this.#policy = opts.policy
    for (const cfg of opts.instances) this.add(cfg)
  }

  add(cfg: InstanceConfig): void {
    if (this.#instances.has(cfg.id)) throw new Error(`duplicate instance id ${cfg.id}`)
    this.#instances.set(cfg.id, {
      id: cfg.id,
      role: cfg.role,
      url: new URL(cfg.url).origin,
      labels: Object.freeze({ ...(cfg.labels ?? {}) }),
      engineId: undefined,
      probedUp: undefined,
      consecutiveFailures: 0,
      ejections: 0,
      ejectedUntil: 0,
      inflight: 0,
      models: undefined,
    })
    this.#snapshot = undefined
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
    this.#get(id).inflight++
    this.#snapshot = undefined
  }

  release(id: string): void {
    const s = this.#get(id)
    s.inflight = Math.max(0, s.inflight - 1)
    this.#snapshot = undefined
  }

  /** A request or probe succeeded: the failure streak ends. */
  recordSuccess(id: string): void {
    const s = this.#get(id)
    if (s.consecutiveFailures === 0 && s.probedUp !== false) return
    s.consecutiveFailures = 0
    this.#snapshot = undefined
  }

  /**
   * A request failed in a way that says the instance is unwell. After `unhealthyThreshold`
   * in a row it is ejected, for longer each time (outlier detection with backoff).
   */
  recordFailure(id: string): void {
    const s = this.#get(id)
    s.consecutiveFailures++
    if (s.consecutiveFailures >= this.#policy.unhealthyThreshold && this.#clock.monotonic() >= s.ejectedUntil) {
      const ms = Math.min(this.#policy.baseEjectionMs * 2 ** s.ejections, this.#policy.maxEjectionMs)
      s.ejections++
      s.ejectedUntil = this.#clock.monotonic() + ms
      s.consecutiveFailures = 0
    }
    this.#snapshot = undefined
  }

  /** An active probe's verdict. A passing probe after an ejection ends it early. */
  recordProbe(id: string, up: boolean, models?: readonly string[]): void {
    const s = this.#get(id)
    const wasUp = s.probedUp
    s.probedUp = up
    if (up) {
      s.consecutiveFailures = 0
      if (wasUp === false) s.ejectedUntil = 0
      if (models) s.models = new Set(models)
      // A long healthy run forgives earlier ejections.
      if (wasUp === true && s.ejectedUntil === 0) s.ejections = 0
    }
    this.#snapshot = undefined
  }

  needsModels(id: string): boolean {
    return this.#get(id).models === undefined
  }

  isUp(id: string): boolean {
    return eligible(this.#get(id), this.#clock.monotonic())
  }

  /**
   * Records the engine_id an instance answered with. Returns the change when the address
   * previously had another engine_id: the old incarnation is gone (a peer_gone seam).
   */
  observeEngineId(id: string, engineId: string): EngineIdChange | undefined {
    const s = this.#get(id)
    if (s.engineId === engineId) return undefined
    const previous = s.engineId
    s.engineId = engineId
    this.#snapshot = undefined
    return previous === undefined ? undefined : { instanceId: id, address: new URL(s.url).host, previous, current: engineId }
  }

  snapshot(): TopologySnapshot {
    // Ejections expire with time, so a cached snapshot is only reused within one millisecond tick.
    if (this.#snapshot) return this.#snapshot
    const now = this.#clock.monotonic()
    const models = new Set<string>()
    const instances: InstanceView[] = []
    for (const s of this.#instances.values()) {
      if (s.models) for (const m of s.models) models.add(m)
      instances.push(
        Object.freeze({
          id: s.id,
          role: s.role,
          url: s.url,
          labels: s.labels,
          engineId: s.engineId,
          healthy: eligible(s, now),
          inflight: s.inflight,
          models: s.models,
        }),
      )
    }
    const snap: TopologySnapshot = Object.freeze({ instances: Object.freeze(instances), models })
    // Cache only while no ejection is pending expiry; otherwise rebuild each time.
    const pending = [...this.#instances.values()].some((s) => s.ejectedUntil > now)
    if (!pending) this.#snapshot = snap
    return snap
  }

  #get(id: string): InstanceState {
    const s = this.#instances.get(id)
    if (!s) throw new Error(`unknown instance ${id}`)
    return s
  }
}
