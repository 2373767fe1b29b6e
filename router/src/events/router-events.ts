import type { AgentRegistration } from '../../../schemas/events.js'
import type { EventStore } from '../store/event-store.js'
import type { TopologyRegistry } from '../topology/registry.js'
import { SIDE_CHANNEL_LABEL } from '../topology/views.js'
import { RTR_ERR_TOO_MANY_AGENTS } from '../errors.js'
import { AgentDirectory, type AgentRecord } from './agent-directory.js'
import { BoundedSet } from './bounded-set.js'
import type { LeaseReleaseInput, LoggedEvent } from './event-log.js'

/**
 * Where the router decides to tell the agents something (DESIGN "Events"): an engine_id that
 * is gone (a new engine_id under its rank at an instance, topology/engine-ids.ts; a crash,
 * ops tooling, a drained instance) becomes one `peer_gone`; a lease nobody will read becomes
 * a `lease_release` for the prefiller's agent. Both go into the one ordered log (the event
 * store, shared by every router on Redis); the stream routes deliver them.
 *
 * What the router decides by itself (an engine_id change, a crash, a lease to release) must
 * not be lost to a store outage: such an append that fails is retried, in order, until the
 * store takes it. What a caller asks for (ops, an agent's registration) fails instead, so the
 * caller hears it (RTR_ERR_STORE_UNAVAILABLE).
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
  /**
   * Engine_ids an address resolved to that are up and answering under that id (probes pass,
   * or one of their agents holds a stream): left alone. Naming the engine_id forces it.
   */
  aliveSkipped: string[]
  /** Whether a new event was logged (false for a repeat or an unknown target). */
  logged: boolean
}

export interface EventsLogger {
  info(obj: object, msg: string): void
  warn(obj: object, msg: string): void
  error(obj: object, msg: string): void
}

export interface RouterEventsMetrics {
  events: { inc(labels: { type: string }): void }
  /** Decisions the store refused for good (not an outage): dropped, so later ones go on. */
  decisionsDropped?: { inc(): void }
}

/** Which agents hold an event stream now, on any router sharing the store. */
export interface StreamPresence {
  anyOpen(agentIds: readonly string[]): Promise<boolean>
}

export class RouterEvents {
  readonly store: EventStore
  readonly agents: AgentDirectory
  readonly #registry: TopologyRegistry
  readonly #logger: EventsLogger
  readonly #metrics: RouterEventsMetrics | undefined
  /**
   * Engine_ids seen before (agents, replaced incarnations); with the instances' current ones
   * from the registry (learned from prefill answers) they are what "known" means. Bounded:
   * re-registrations under new engine_ids add one each.
   */
  readonly #known: BoundedSet<string>
  /**
   * Engine_ids the log holds as gone, as far as this router heard (its store subscription):
   * a cheap filter for `engineAnswered` on the request path. The store decides.
   */
  readonly #goneHeard: BoundedSet<string>
  readonly #unsubscribeStore: () => void
  readonly #maxAgents: number

  readonly #presence: StreamPresence
  readonly #onLogged: ((event: LoggedEvent) => void) | undefined
  /** The router's own decisions waiting for the store to come back, oldest first. */
  readonly #retries: { what: string; run: () => Promise<unknown> }[] = []
  readonly #retryMs: number
  #retrying: ReturnType<typeof setTimeout> | undefined
  #tail: Promise<unknown> = Promise.resolve()
  #closed = false

  constructor(opts: {
    store: EventStore
    agents: AgentDirectory
    registry: TopologyRegistry
    logger: EventsLogger
    metrics?: RouterEventsMetrics
    /** Default: this router's own streams (one router). */
    presence?: StreamPresence
    /** Each event this router logged (not other routers'): engine mode's notifications. */
    onLogged?: (event: LoggedEvent) => void
    /** How often a decision the store refused is tried again, ms (default 1000). */
    retryMs?: number
    /** Agents the directory may hold (default 1024); past it a new agent is refused. */
    maxAgents?: number
    /** Engine_ids remembered as seen (default 8 per agent the directory may hold, at least 4096). */
    knownEngineIds?: number
  }) {
    this.#maxAgents = opts.maxAgents ?? 1024
    this.#known = new BoundedSet(opts.knownEngineIds ?? Math.max(4096, 8 * this.#maxAgents))
    this.#goneHeard = new BoundedSet(opts.knownEngineIds ?? Math.max(4096, 8 * this.#maxAgents))
    this.store = opts.store
    this.agents = opts.agents
    this.#registry = opts.registry
    this.#logger = opts.logger
    this.#metrics = opts.metrics
    this.#onLogged = opts.onLogged
    this.#retryMs = opts.retryMs ?? 1000
    this.#presence = opts.presence ?? {
      anyOpen: async (ids) => ids.some((id) => (this.agents.get(id)?.streams ?? 0) > 0),
    }
    this.#unsubscribeStore = opts.store.subscribe((event) => {
      if (event.type === 'peer_gone') for (const id of event.engineIds) this.#goneHeard.add(id)
      else if (event.type === 'peer_alive') for (const id of event.engineIds) this.#goneHeard.delete(id)
      else if (event.type === 'snapshot') for (const id of event.goneEngineIds) this.#goneHeard.add(id)
    })
    // What was declared gone before this router started (a shared log outlives its routers).
    opts.store.snapshot().then(
      (s) => {
        for (const id of s.goneEngineIds) this.#goneHeard.add(id)
      },
      () => undefined,
    )
    opts.registry.subscribe((change) => {
      // After the registry has told everyone (it is mid-notification now).
      if (change.type === 'added') queueMicrotask(() => this.#adopt(change.instanceId))
      if (change.type === 'refusing') this.#decide(`crash check of ${change.instanceId}`, () => this.#crashed(change.instanceId))
      if (change.type === 'engine_id_learned') {
        this.#known.add(change.engineId)
        if (change.sharedRanks) this.#logger.warn({ instance: change.instanceId, engineId: change.engineId }, 'an engine_id replaced at this URL answered again: the URL fronts several engines per rank, and from now on no engine_id there replaces another')
      }
      if (change.type !== 'engine_id_changed') return
      this.#known.add(change.previous).add(change.current)
      this.#decide(`peer_gone for ${change.previous}`, () => this.peerGone({ engineIds: [change.previous] }, `engine_id_changed at ${change.address}`))
    })
  }

  /** An agent's event stream closed; with its instance refusing connections too, the instance crashed. */
  streamClosed(agentId: string): void {
    this.agents.streamClosed(agentId)
    const instance = this.agents.get(agentId)?.instanceId
    if (instance !== undefined && this.#registry.isRefusing(instance)) this.#decide(`crash check of ${instance}`, () => this.#crashed(instance))
  }

  /** Decisions still waiting for the store (0 when it took everything). */
  get pending(): number {
    return this.#retries.length
  }

  /** Resolves once every decision taken so far reached the store (or is queued for a retry). */
  async settled(): Promise<void> {
    let tail
    do {
      tail = this.#tail
      await tail
    } while (tail !== this.#tail)
  }

  close(): void {
    this.#closed = true
    this.#unsubscribeStore()
    if (this.#retrying) clearTimeout(this.#retrying)
    this.#retrying = undefined
  }

  /**
   * Runs one of the router's own decisions after the ones before it. Refused by a store that
   * is away, it waits in the retry queue (in order) instead of being lost, and so do the ones
   * after it. Refused for good (the store answered, and would answer the same again), it is
   * logged and dropped: one bad decision must not hold back every later one.
   */
  #decide(what: string, run: () => Promise<unknown>): void {
    const go = async (): Promise<void> => {
      if (this.#retries.length > 0) {
        this.#retries.push({ what, run })
        return
      }
      try {
        await run()
      } catch (err) {
        if (!this.#retryable(what, err)) return
        this.#logger.warn({ err: (err as Error).message, what }, 'event store refused a decision; retrying until it takes it')
        this.#retries.push({ what, run })
        this.#scheduleRetry()
      }
    }
    this.#tail = this.#tail.then(go, go)
  }

  /** Whether a refused decision waits for a retry; one refused for good is dropped here. */
  #retryable(what: string, err: unknown): boolean {
    if (this.store.retryable(err)) return true
    this.#metrics?.decisionsDropped?.inc()
    this.#logger.error({ err: (err as Error)?.message ?? String(err), what }, 'event store refused a decision for good (not an outage); dropped so that later decisions go on')
    return false
  }

  #scheduleRetry(): void {
    if (this.#retrying || this.#closed) return
    this.#retrying = setTimeout(() => {
      this.#retrying = undefined
      this.#tail = this.#tail.then(async () => {
        while (this.#retries.length > 0 && !this.#closed) {
          const next = this.#retries[0] as { what: string; run: () => Promise<unknown> }
          let took = true
          try {
            await next.run()
          } catch (err) {
            if (this.#retryable(next.what, err)) {
              this.#scheduleRetry()
              return
            }
            took = false
          }
          this.#retries.shift()
          if (took) this.#logger.info({ what: next.what, left: this.#retries.length }, 'event store took a decision it had refused')
        }
      })
    }, this.#retryMs)
    this.#retrying.unref?.()
  }

  /**
   * A crash: the instance's probes were refused `unhealthyThreshold` times in a row (nothing
   * listens at its address: probes that time out say only that it is frozen or busy, and it is
   * kept) AND none of its agents holds an event stream (a live agent means a partition
   * between router and engine, not a dead engine). Its engine_ids are gone, and its agents
   * leave the directory, so delivery no longer waits for them. An instance without any agent
   * (engine mode) is judged by its probes alone.
   */
  async #crashed(instanceId: string): Promise<void> {
    // Listening again (or gone) by the time this runs: not a crash.
    if (!this.#registry.isRefusing(instanceId) || !this.#registry.has(instanceId)) return
    const agents = this.agents.byInstance(instanceId)
    if (await this.#presence.anyOpen(agents.map((a) => a.agentId))) return
    // The engine's own engine_ids (from its answers; every rank behind the URL), never an agent's claim (registerAgent).
    const ids = new Set(this.#registry.snapshot().instances.find((i) => i.id === instanceId)?.engineIds)
    for (const id of ids) this.#known.add(id)
    // Out of the directory first: delivery of this very peer_gone must not wait for them.
    for (const a of agents) this.agents.remove(a.agentId)
    if (ids.size > 0) this.#decide(`peer_gone for crashed ${instanceId}`, () => this.peerGone({ engineIds: [...ids] }, `instance ${instanceId} down and no agent stream open`))
  }

  /**
   * An agent's registration: records it and ties it to the instance at its engine URL, if
   * the topology has one (issue 18 item 2). A registration never creates, re-addresses or
   * renames an instance, and what it claims is never taken as an engine's word: an instance's
   * engine_id is learned from the engine itself (`remote_engine_id` in its prefill answers),
   * so a caller claiming a new engine_id at a prefiller's URL cannot make the router declare
   * the real engine gone. A record it replaces (the same agentId, or the same peer address)
   * leaves the directory; its engine_id is not declared gone on that word either: the engine's
   * next prefill answer, a crash, or ops do that.
   */
  async registerAgent(reg: AgentRegistration): Promise<AgentRecord> {
    // Before anything is recorded.
    if (this.agents.size >= this.#maxAgents && this.agents.wouldGrow(reg)) throw new RTR_ERR_TOO_MANY_AGENTS(this.#maxAgents, reg.agentId)
    const instance = reg.engineUrl ? this.#instanceByUrl(reg.engineUrl) : undefined
    const { record, gone } = this.agents.register(reg, instance)
    this.#known.add(reg.engineId)
    for (const g of gone) this.#known.add(g.engineId)
    if (gone.length > 0) this.#logger.info({ agentId: reg.agentId, replaced: gone.map((g) => g.engineId) }, 'agent registration replaced a record')
    this.#logger.info({ agentId: reg.agentId, engineId: reg.engineId, instance, peerAddress: record.peerAddress }, 'agent registered')
    return record
  }

  /**
   * `peer_gone` for engine_ids and addresses (an agent's peer address or an instance's
   * host:port). Engine_ids already gone are a no-op answered with the earlier sequence;
   * unknown ones and addresses that resolve to nothing are no-ops. An address names whatever
   * incarnation was there when the caller looked, which may have restarted since: it never
   * resolves to an engine that is up and answering with its engine_id (issue 17 item 6).
   * Those are reported in `aliveSkipped`; naming the engine_id is the way to force one.
   */
  async peerGone(target: PeerGoneTarget, reason: string): Promise<PeerGoneResult> {
    const ids = new Set<string>()
    const unknown: string[] = []
    const aliveSkipped: string[] = []
    const current = new Set(this.#registry.snapshot().instances.flatMap((i) => i.engineIds))
    for (const a of this.agents.all()) current.add(a.engineId)
    for (const id of target.engineIds ?? []) {
      if (this.#known.has(id) || current.has(id) || (await this.store.isGone(id))) ids.add(id)
      else unknown.push(id)
    }
    const addresses: string[] = []
    for (const address of target.addresses ?? []) {
      const found = this.#resolve(address)
      if (found.length === 0) unknown.push(address)
      let any = false
      for (const id of found) {
        // Already declared gone: a repeat, whatever it says now.
        if (ids.has(id) || (await this.store.isGone(id))) {
          ids.add(id)
          any = true
        } else if (await this.#alive(id)) {
          if (!aliveSkipped.includes(id)) aliveSkipped.push(id)
        } else {
          ids.add(id)
          any = true
        }
      }
      if (any) addresses.push(address)
    }
    if (aliveSkipped.length > 0) this.#logger.warn({ aliveSkipped, addresses: target.addresses, reason }, 'peer_gone by address: engines up there now are left alone')
    if (ids.size === 0) return { seq: null, engineIds: [], unknown, aliveSkipped, logged: false }
    const peerAddresses = new Set(addresses)
    for (const id of ids) for (const a of this.agents.byEngine(id)) peerAddresses.add(a.peerAddress)
    for (const inst of this.#registry.snapshot().instances) {
      const side = inst.labels[SIDE_CHANNEL_LABEL]
      if (side && inst.engineIds.some((e) => ids.has(e))) peerAddresses.add(side)
    }
    // Only engine_ids not gone yet are logged, checked in the same step across every router.
    const input = { type: 'peer_gone' as const, engineIds: [...ids], addresses: [...peerAddresses], reason }
    const event = await this.store.appendPeerGone(input, this.agents.all().map((a) => a.agentId))
    if (!event) {
      const earlier = await this.store.lastPeerGone([...ids])
      return { seq: earlier?.seq ?? (await this.store.last()), engineIds: [...ids], unknown, aliveSkipped, logged: false }
    }
    this.#logged(event)
    this.#logger.warn({ seq: event.seq, engineIds: event.engineIds, addresses: event.addresses, reason }, 'peer_gone')
    return { seq: event.seq, engineIds: event.engineIds, unknown, aliveSkipped, logged: true }
  }

  /** Up and answering under `engineId`: an instance with it passes its probes, or an agent running it holds a stream. */
  async #alive(engineId: string): Promise<boolean> {
    if (this.#registry.snapshot().instances.some((i) => i.engineIds.includes(engineId) && this.#registry.isUp(i.id))) return true
    const agents = this.agents.byEngine(engineId)
    return agents.length > 0 && (await this.#presence.anyOpen(agents.map((a) => a.agentId)))
  }

  /**
   * A prefill answer named `engineId` (`remote_engine_id`, the engine's own word): an engine
   * declared gone is alive again under it (a crash that was a restart under a configured
   * engine_id, ops that were wrong). Agents tombstoned it for minutes; `peer_alive` lifts that,
   * so decoders read its blocks again (issue 17 item 6). On the request path: a set lookup,
   * and the append only for an engine_id this router heard declared gone.
   */
  engineAnswered(engineId: string): void {
    if (!this.#goneHeard.has(engineId)) return
    this.#goneHeard.delete(engineId)
    this.#decide(`peer_alive for ${engineId}`, () => this.peerAlive([engineId], 'answered a prefill under its engine_id'))
  }

  /** `peer_alive` for those of `engineIds` the log holds as gone; nothing when none is. */
  async peerAlive(engineIds: readonly string[], reason: string): Promise<number | null> {
    const event = await this.store.appendPeerAlive({ type: 'peer_alive', engineIds: [...engineIds], reason }, this.agents.all().map((a) => a.agentId))
    if (!event) return null
    this.#logged(event)
    this.#logger.warn({ seq: event.seq, engineIds: event.engineIds, reason }, 'peer_alive')
    return event.seq
  }

  /**
   * A lease nobody will read (the client left between the legs, D failed or is gone): the
   * prefiller's agent frees the blocks now instead of at expiry. Returns the sequence, or
   * null when no agent runs that engine (engine mode: the engine keeps its own lease).
   */
  async releaseLease(input: Omit<LeaseReleaseInput, 'type'>): Promise<number | null> {
    const owners = this.agents.byEngine(input.prefillEngineId)
    if (owners.length === 0) return null
    const event = await this.store.append({ type: 'lease_release', ...input }, owners.map((a) => a.agentId))
    this.#logged(event)
    return event.seq
  }

  /** The request path's release: never waits, never fails (a refused append is retried). */
  releaseLater(input: Omit<LeaseReleaseInput, 'type'>): void {
    this.#decide(`lease_release to ${input.prefillEngineId}`, () => this.releaseLease(input))
  }

  #logged(event: LoggedEvent): void {
    this.#metrics?.events.inc({ type: event.type })
    this.#onLogged?.(event)
  }

  /** Engine_ids at an address: agents there, and instances whose URL has that host:port. */
  #resolve(address: string): string[] {
    const ids = new Set(this.agents.engineIdsAt(address))
    for (const inst of this.#registry.snapshot().instances) {
      if (new URL(inst.url).host === address || inst.labels[SIDE_CHANNEL_LABEL] === address) for (const e of inst.engineIds) ids.add(e)
    }
    return [...ids]
  }

  /**
   * The instance an agent's engine URL belongs to: never a draining one. A draining instance
   * admits nothing new, so an agent that registers for its URL runs another incarnation (with
   * IP reuse, a new pod at an old pod's address); tied to the old instance, it would be
   * retired with it (peer_gone for a live engine_id). It is adopted by the instance that
   * joins at that URL instead.
   */
  #instanceByUrl(url: string): string | undefined {
    const want = normalize(url)
    return this.#registry.snapshot().instances.find((i) => !i.draining && normalize(i.url) === want)?.id
  }

  /**
   * An instance joined: agents registered for its URL before it did (in Kubernetes an agent
   * registers when its engine starts, before the pod is Ready) are tied to it now, so its
   * crash check sees their streams. Their engine_ids stay claims (see registerAgent).
   */
  #adopt(instanceId: string): void {
    const view = this.#registry.snapshot().instances.find((i) => i.id === instanceId)
    if (!view || view.draining) return
    const want = normalize(view.url)
    for (const a of this.agents.all()) {
      if (a.instanceId !== undefined || !a.engineUrl || normalize(a.engineUrl) !== want) continue
      const { streams: _streams, ...record } = a
      this.agents.put({ ...record, instanceId })
      this.#logger.info({ agentId: a.agentId, engineId: a.engineId, instance: instanceId }, 'agent adopted by the instance that joined at its engine URL')
    }
  }
}

function normalize(url: string): string {
  const u = new URL(url)
  return `${u.protocol}//${u.host}${u.pathname.replace(/\/+$/, '')}`
}
