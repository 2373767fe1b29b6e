import type { Clock } from '../../../common/clock.js'
import type { AgentRegistration } from '../../../schemas/events.js'

/**
 * The transfer agents the router knows (DESIGN "Topology": an instance's agent). An agent
 * registers once its engine attached, with its engine_id, its own URL (whose host:port is
 * the peer address other agents handshake with) and its engine's URL. What it means for the
 * topology is the caller's business; this keeps the records, their open event streams, and
 * answers "who runs engine X" and "who should get this event".
 */
export interface AgentRecord {
  readonly agentId: string
  readonly engineId: string
  readonly role: AgentRegistration['role']
  /** transfer-agent (checks its READs against the lease) or vllm-connector (does not). */
  readonly kind: NonNullable<AgentRegistration['kind']>
  readonly agentUrl: string
  /** host:port of agentUrl: the address peers know this agent's engine by. */
  readonly peerAddress: string
  readonly engineUrl: string | undefined
  /** The topology instance whose URL is engineUrl, if any. */
  readonly instanceId: string | undefined
  readonly registeredAt: number
  /** Event streams open now, on this router. */
  streams: number
  /**
   * Wall ms it was last known connected: registered, a stream opened or closed, or (several
   * routers) refreshed by the router holding its open stream (refreshConnected).
   */
  lastSeenAt: number
}

/** What a registration replaced: engine_ids that are gone because of it. */
export interface Registered {
  record: AgentRecord
  /** Engine_ids this registration proves gone (same agent or same peer address, new engine). */
  gone: { engineId: string; peerAddress: string; reason: string }[]
}

/** An agent's record was written (registration, or another router's) or removed (undefined). */
export type AgentChangeListener = (agentId: string, record: AgentRecord | undefined) => void

export class AgentDirectory {
  readonly #clock: Clock
  readonly #agents = new Map<string, AgentRecord>()
  readonly #listeners = new Set<AgentChangeListener>()
  /** How long an agent without an open stream is still trusted to check its reads, ms. */
  readonly trustMs: number

  /**
   * `trustMs`: an agent whose stream closed is still trusted to check its engine's reads this
   * long (one that reconnects does so within about three keep-alive intervals), and one that
   * registered but never opened a stream, this long after its registration. Default 15 s.
   */
  constructor(opts: { clock: Clock; trustMs?: number }) {
    this.#clock = opts.clock
    this.trustMs = opts.trustMs ?? 15_000
  }

  get size(): number {
    return this.#agents.size
  }

  /**
   * Whether `reg` would add a record: a new agentId at an address no agent holds. A known
   * agent registering again, or a new one replacing the agent at its address, would not.
   */
  wouldGrow(reg: AgentRegistration): boolean {
    if (this.#agents.has(reg.agentId)) return false
    const peerAddress = new URL(reg.agentUrl).host
    for (const a of this.#agents.values()) if (a.peerAddress === peerAddress) return false
    return true
  }

  register(reg: AgentRegistration, instanceId: string | undefined): Registered {
    const now = this.#clock.now()
    const peerAddress = new URL(reg.agentUrl).host
    const gone: Registered['gone'] = []
    const previous = this.#agents.get(reg.agentId)
    if (previous && previous.engineId !== reg.engineId) {
      gone.push({ engineId: previous.engineId, peerAddress: previous.peerAddress, reason: 'engine_id_changed' })
    }
    // Another agent at the same address: the process there restarted (a new agentId).
    for (const other of [...this.#agents.values()]) {
      if (other.agentId === reg.agentId || other.peerAddress !== peerAddress) continue
      this.remove(other.agentId)
      if (other.engineId !== reg.engineId) gone.push({ engineId: other.engineId, peerAddress, reason: 'engine_id_changed' })
    }
    const record: AgentRecord = {
      agentId: reg.agentId,
      engineId: reg.engineId,
      role: reg.role,
      kind: reg.kind ?? 'transfer-agent',
      agentUrl: reg.agentUrl,
      peerAddress,
      engineUrl: reg.engineUrl,
      instanceId,
      registeredAt: previous && previous.engineId === reg.engineId ? previous.registeredAt : now,
      streams: previous?.streams ?? 0,
      lastSeenAt: now,
    }
    this.#agents.set(reg.agentId, record)
    this.#emit(reg.agentId, record)
    return { record, gone }
  }

  /** Calls `listener` after every record written or removed; returns the unsubscribe function. */
  subscribe(listener: AgentChangeListener): () => void {
    this.#listeners.add(listener)
    return () => this.#listeners.delete(listener)
  }

  /**
   * Another router's record (several routers on one store): kept as written there, with this
   * router's own count of open streams.
   */
  put(record: Omit<AgentRecord, 'streams'>): void {
    const streams = this.#agents.get(record.agentId)?.streams ?? 0
    const next: AgentRecord = { ...record, streams }
    this.#agents.set(record.agentId, next)
    this.#emit(record.agentId, next)
  }

  #emit(agentId: string, record: AgentRecord | undefined): void {
    for (const l of this.#listeners) l(agentId, record)
  }

  get(agentId: string): AgentRecord | undefined {
    return this.#agents.get(agentId)
  }

  remove(agentId: string): boolean {
    if (!this.#agents.delete(agentId)) return false
    this.#emit(agentId, undefined)
    return true
  }

  all(): AgentRecord[] {
    return [...this.#agents.values()]
  }

  /** The agents running `engineId` (normally one). */
  byEngine(engineId: string): AgentRecord[] {
    return this.all().filter((a) => a.engineId === engineId)
  }

  /**
   * Whether a transfer agent runs instance `instanceId`'s engine, and so checks its reads
   * against the lease (on the request path: no array is built). Only a live one: its stream is
   * open (here, or on another router that keeps its record fresh), or was within `trustMs`.
   * A registration alone would trust the instance for ever, also once a stock engine that
   * checks nothing serves at its URL (issue 37 item 4): then the router checks it as stock.
   */
  checksReads(instanceId: string): boolean {
    let now: number | undefined
    for (const a of this.#agents.values()) {
      if (a.instanceId !== instanceId || a.kind !== 'transfer-agent') continue
      if (a.streams > 0) return true
      now ??= this.#clock.now()
      if (now - a.lastSeenAt <= this.trustMs) return true
    }
    return false
  }

  /**
   * Several routers: the agents whose streams this router holds are known connected now; their
   * records are written again (subscribers share them), so the other routers keep trusting them.
   */
  refreshConnected(): void {
    const now = this.#clock.now()
    for (const a of this.#agents.values()) {
      if (a.streams === 0) continue
      a.lastSeenAt = now
      this.#emit(a.agentId, a)
    }
  }

  /**
   * Whether an agent of `engineId` holds an event stream open on this router now: the engine
   * is alive (engine-ids.ts). Not the trust window: a dead agent's record stays fresh a while.
   */
  streamOpenFor(engineId: string): boolean {
    for (const a of this.#agents.values()) if (a.engineId === engineId && a.streams > 0) return true
    return false
  }

  byInstance(instanceId: string): AgentRecord[] {
    return this.all().filter((a) => a.instanceId === instanceId)
  }

  /** Engine_ids of agents whose peer address is `address`. */
  engineIdsAt(address: string): string[] {
    return this.all()
      .filter((a) => a.peerAddress === address)
      .map((a) => a.engineId)
  }

  /** Marks a stream opened or closed; the record is written again when it connects or disconnects. */
  streamOpened(agentId: string): void {
    const a = this.#agents.get(agentId)
    if (!a) return
    a.streams++
    a.lastSeenAt = this.#clock.now()
    if (a.streams === 1) this.#emit(agentId, a)
  }

  streamClosed(agentId: string): void {
    const a = this.#agents.get(agentId)
    if (!a) return
    a.streams = Math.max(0, a.streams - 1)
    a.lastSeenAt = this.#clock.now()
    if (a.streams === 0) this.#emit(agentId, a)
  }
}
