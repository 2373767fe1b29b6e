import type { AgentRegistration } from '../../../schemas/events.js'
import type { TopologyRegistry } from '../topology/registry.js'
import { AgentDirectory, type AgentRecord } from './agent-directory.js'
import type { EventLog, LeaseReleaseInput, LoggedEvent } from './event-log.js'

/**
 * Where the router decides to tell the agents something (DESIGN "Events"): an engine_id that
 * is gone (a new engine_id at an address, an agent re-registering under another engine,
 * ops tooling, a drained instance) becomes one `peer_gone`; a lease nobody will read becomes
 * a `lease_release` for the prefiller's agent. Both go into the one ordered log; the stream
 * routes deliver them.
 */
export interface PeerGoneTarget {
  engineIds?: readonly string[]
  addresses?: readonly string[]
}

export interface PeerGoneResult {
  /** The event's sequence (an earlier one's for a repeat); null when nothing was known. */
  seq: number | null
  engineIds: string[]
  /** Named engine_ids and addresses that resolve to nothing the router knows (no-ops). */
  unknown: string[]
  /** Whether a new event was logged (false for a repeat or an unknown target). */
  logged: boolean
}

export interface EventsLogger {
  info(obj: object, msg: string): void
  warn(obj: object, msg: string): void
}

export interface RouterEventsMetrics {
  events: { inc(labels: { type: string }): void }
}

export class RouterEvents {
  readonly log: EventLog
  readonly agents: AgentDirectory
  readonly #registry: TopologyRegistry
  readonly #logger: EventsLogger
  readonly #metrics: RouterEventsMetrics | undefined
  /**
   * Engine_ids seen before (agents, replaced incarnations); with the instances' current ones
   * from the registry (learned from prefill answers) they are what "known" means.
   */
  readonly #known = new Set<string>()

  /** Whether an agent naming an engine URL the topology lacks adds that engine (agent token only). */
  readonly #addInstances: boolean

  constructor(opts: {
    log: EventLog
    agents: AgentDirectory
    registry: TopologyRegistry
    logger: EventsLogger
    metrics?: RouterEventsMetrics
    addInstances?: boolean
  }) {
    this.#addInstances = opts.addInstances ?? false
    this.log = opts.log
    this.agents = opts.agents
    this.#registry = opts.registry
    this.#logger = opts.logger
    this.#metrics = opts.metrics
    opts.registry.subscribe((change) => {
      if (change.type === 'down') this.#crashed(change.instanceId)
      if (change.type !== 'engine_id_changed') return
      this.#known.add(change.previous).add(change.current)
      this.peerGone({ engineIds: [change.previous] }, `engine_id_changed at ${change.address}`)
    })
  }

  /** An agent's event stream closed; with its instance down too, the instance crashed. */
  streamClosed(agentId: string): void {
    this.agents.streamClosed(agentId)
    const instance = this.agents.get(agentId)?.instanceId
    if (instance !== undefined && !this.#registry.isUp(instance)) this.#crashed(instance)
  }

  /**
   * A crash: the instance failed its probes AND none of its agents holds an event stream (a
   * live agent means a partition between router and engine, not a dead engine). Its
   * engine_ids are gone, and its agents leave the directory, so delivery no longer waits for
   * them. An instance without any agent (engine mode) is judged by its probes alone.
   */
  #crashed(instanceId: string): void {
    const agents = this.agents.byInstance(instanceId)
    if (agents.some((a) => a.streams > 0)) return
    const ids = new Set(agents.map((a) => a.engineId))
    const current = this.#registry.snapshot().instances.find((i) => i.id === instanceId)?.engineId
    if (current) ids.add(current)
    for (const a of agents) this.agents.remove(a.agentId)
    if (ids.size > 0) this.peerGone({ engineIds: [...ids] }, `instance ${instanceId} down and no agent stream open`)
  }

  /** An agent's registration: records it, ties it to its instance, and reports what it replaced. */
  registerAgent(reg: AgentRegistration): AgentRecord {
    const instance = reg.engineUrl ? (this.#instanceByUrl(reg.engineUrl) ?? this.#addInstance(reg)) : undefined
    const { record, gone } = this.agents.register(reg, instance)
    this.#known.add(reg.engineId)
    for (const g of gone) this.peerGone({ engineIds: [g.engineId], addresses: [] }, `${g.reason}: agent ${reg.agentId} at ${g.peerAddress}`)
    // After the agent's own peer_gone, so the registry's engine_id change finds it already gone.
    if (instance) this.#registry.observeEngineId(instance, reg.engineId)
    this.#logger.info({ agentId: reg.agentId, engineId: reg.engineId, instance, peerAddress: record.peerAddress }, 'agent registered')
    return record
  }

  /**
   * `peer_gone` for engine_ids and addresses (an agent's peer address or an instance's
   * host:port). Engine_ids already gone are a no-op answered with the earlier sequence;
   * unknown ones and addresses that resolve to nothing are no-ops.
   */
  peerGone(target: PeerGoneTarget, reason: string): PeerGoneResult {
    const ids = new Set<string>()
    const unknown: string[] = []
    const current = new Set(this.#registry.snapshot().instances.map((i) => i.engineId))
    for (const id of target.engineIds ?? []) {
      if (this.#known.has(id) || current.has(id) || this.log.isGone(id)) ids.add(id)
      else unknown.push(id)
    }
    const addresses: string[] = []
    for (const address of target.addresses ?? []) {
      const found = this.#resolve(address)
      if (found.length === 0) unknown.push(address)
      else addresses.push(address)
      for (const id of found) ids.add(id)
    }
    const fresh = [...ids].filter((id) => !this.log.isGone(id))
    if (fresh.length === 0) {
      const earlier = ids.size > 0 ? this.log.lastPeerGone([...ids]) : undefined
      return { seq: earlier?.seq ?? (ids.size > 0 ? this.log.last : null), engineIds: [...ids], unknown, logged: false }
    }
    const peerAddresses = new Set(addresses)
    for (const id of fresh) for (const a of this.agents.byEngine(id)) peerAddresses.add(a.peerAddress)
    const event = this.#append({ type: 'peer_gone', engineIds: fresh, addresses: [...peerAddresses], reason }, this.agents.all().map((a) => a.agentId))
    this.#logger.warn({ seq: event.seq, engineIds: fresh, addresses: [...peerAddresses], reason }, 'peer_gone')
    return { seq: event.seq, engineIds: fresh, unknown, logged: true }
  }

  /**
   * A lease nobody will read (the client left between the legs, D failed or is gone): the
   * prefiller's agent frees the blocks now instead of at expiry. Returns the sequence, or
   * null when no agent runs that engine (engine mode: the engine keeps its own lease).
   */
  releaseLease(input: Omit<LeaseReleaseInput, 'type'>): number | null {
    const owners = this.agents.byEngine(input.prefillEngineId)
    if (owners.length === 0) return null
    return this.#append({ type: 'lease_release', ...input }, owners.map((a) => a.agentId)).seq
  }

  #append(input: Parameters<EventLog['append']>[0], expected: string[]): LoggedEvent {
    const event = this.log.append(input, expected)
    this.#metrics?.events.inc({ type: event.type })
    return event
  }

  /** Engine_ids at an address: agents there, and instances whose URL has that host:port. */
  #resolve(address: string): string[] {
    const ids = new Set(this.agents.engineIdsAt(address))
    for (const inst of this.#registry.snapshot().instances) {
      if (inst.engineId && new URL(inst.url).host === address) ids.add(inst.engineId)
    }
    return [...ids]
  }

  /**
   * Self-registration (DESIGN "Topology"): an agent whose engine the topology lacks brings it
   * in, under the id `<role>:<host>:<port>`. Only when agents authenticate (agentToken): the
   * router must never dial an address an unauthenticated caller handed it.
   */
  #addInstance(reg: AgentRegistration): string | undefined {
    if (!this.#addInstances || !reg.engineUrl) return undefined
    const url = new URL(reg.engineUrl)
    const id = `${reg.role}:${url.hostname}:${url.port || (url.protocol === 'https:' ? '443' : '80')}`.replace(/[^A-Za-z0-9._:-]/g, '_')
    if (this.#registry.has(id)) return undefined
    this.#registry.add({ id, role: reg.role, url: url.origin }, 'agent')
    this.#logger.info({ instance: id, url: url.origin, agentId: reg.agentId }, 'instance added by its agent')
    return id
  }

  #instanceByUrl(url: string): string | undefined {
    const want = normalize(url)
    return this.#registry.snapshot().instances.find((i) => normalize(i.url) === want)?.id
  }
}

function normalize(url: string): string {
  const u = new URL(url)
  return `${u.protocol}//${u.host}${u.pathname.replace(/\/+$/, '')}`
}
