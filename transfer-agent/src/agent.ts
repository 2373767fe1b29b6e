import type { Logger } from 'pino'
import type { Clock } from '../../common/clock.js'
import type { Random } from '../../common/random.js'
import type { Notification } from '../../native/index.js'
import type { AgentAttach, AgentAttached, LeaseGranted, PeerGoneRequest, PeerHandshake, PullDone, PullExpected, PullExpectation, PullRequest } from '../../schemas/agent-api.js'
import type { AgentConfig } from '../../schemas/agent-config.js'
import { Attachment } from './attachment.js'
import { DEFAULT_SAFETY_MS } from './deadline.js'
import { EngineEvents } from './engine-events.js'
import { xfaError } from './errors.js'
import { createHandshake } from './handshake-client.js'
import { peerKey } from './peer-proof.js'
import { HeartbeatSender } from './heartbeat-sender.js'
import { HeartbeatRegistry } from './heartbeats.js'
import type { AgentMetrics } from './metrics.js'
import { PeerTable } from './peers.js'
import { parsePrefillNotification, PrefillLeases } from './prefill-leases.js'
import { Puller, type PullReport } from './pulls.js'
import { RouterLink } from './router-link.js'
import { hostPort } from '../../common/host-port.js'

/**
 * One transfer agent: the engine it serves (attachment), its prefiller leases, its
 * decoder pulls, peers and heartbeats, and what it tells the engine. The HTTP surface is
 * app.ts; this is the behaviour, so it reads without routes in the way.
 */
export interface TransferAgentDeps {
  config: Readonly<AgentConfig>
  clock: Clock
  random: Random
  log: Logger
  metrics: AgentMetrics
  /** Where peers reach this agent (host:port of the HTTP server), known once it listens. */
  peerAddress: () => { host: string; port: number }
}

export class TransferAgent {
  readonly agentId: string
  readonly events: EngineEvents
  readonly #d: TransferAgentDeps
  readonly #leaseMs: number
  readonly #heartbeats: HeartbeatRegistry
  readonly #peers: PeerTable
  readonly #puller: Puller
  readonly #sender: HeartbeatSender
  readonly #handshake: ReturnType<typeof createHandshake>
  readonly #routerLink: RouterLink | undefined
  #attachment: Attachment | undefined
  #attaching: Promise<Attachment> | undefined
  #leases: PrefillLeases | undefined
  #closed = false

  constructor(deps: TransferAgentDeps) {
    this.#d = deps
    const { config, clock, metrics, log } = deps
    this.agentId = `agent-${deps.random.hex(8)}`
    this.#leaseMs = config.leaseSeconds * 1000
    this.events = new EngineEvents({ clock })
    this.#heartbeats = new HeartbeatRegistry({ clock })
    const key = agentPeerKey(config)
    this.#handshake = createHandshake({ clock, timeoutMs: config.handshakeTimeoutMs, caller: this.agentId, ...(key ? { peerKey: key } : {}) })
    this.#peers = new PeerTable({
      clock,
      handshake: async (address, expected, signal) => {
        try {
          const r = await this.#handshake.handshake(address, expected, signal)
          metrics.handshakes.inc({ outcome: 'ok' })
          metrics.clockUncertainty.observe(r.clock.uncertaintyMs / 1000)
          // Past a quarter lease the deadline proof does not hold: no heartbeat credit then.
          const level = r.clock.uncertaintyMs > this.#leaseMs / 4 ? 'warn' : 'info'
          log[level]({ peer: r.engineId, address, rttMs: r.clock.rttMs, uncertaintyMs: r.clock.uncertaintyMs }, 'handshake done')
          return r
        } catch (err) {
          metrics.handshakes.inc({ outcome: 'failed' })
          throw err
        }
      },
      gate: {
        loadPeer: (engineId, md, opts) => this.#requireAttached().nixl.loadPeer(engineId, md, opts),
        forgetPeer: async (engineId) => {
          // A peer loaded into an attachment that was since replaced went with that agent.
          const att = this.#attachment
          if (att && att.nixl.peers().some((p) => p.engineId === engineId)) await att.nixl.forgetPeer(engineId)
        },
      },
      onRelease: (r) => {
        metrics.peerReleases.inc({ reason: r.reason })
        log.info({ peer: r.engineId, address: r.address, reason: r.reason, loaded: r.loaded, error: r.error }, 'peer released')
      },
    })
    this.#puller = new Puller({
      clock,
      peers: this.#peers,
      heartbeats: this.#heartbeats,
      target: () => this.#attachment,
      leaseMs: this.#leaseMs,
      safetyMs: config.safetyMs ?? DEFAULT_SAFETY_MS,
      readTimeoutMs: config.readTimeoutMs,
      checkDeadlines: !config.unsafeSkipDeadlineChecks,
      allowNoExpiry: config.allowNoExpiry,
      onQuiesced: (requestId, blockIds) => {
        this.events.push({ type: 'pull_quiesced', requestId, blockIds: [...blockIds] })
        metrics.engineEventsPending.set(this.events.pending)
      },
      onGaveUp: (engineId, remoteRequestId) => this.#gaveUp(engineId, remoteRequestId),
      onPeerReady: (engineId) => void this.#sender.sendTo(engineId),
      onSettled: (r) => this.#settled(r),
    })
    this.#sender = new HeartbeatSender({
      clock,
      heartbeats: this.#heartbeats,
      intervalMs: config.heartbeatMs ?? this.#leaseMs / 6,
      // Far inside the margin (≥ safety or lease/4): a send slower than this may reach P late.
      maxSendMs: Math.min(1000, this.#leaseMs / 20),
      canSend: (engineId) => this.#attachment?.nixl.peers().some((p) => p.engineId === engineId) ?? false,
      send: (engineId, message) => this.#requireAttached().nixl.genNotif(engineId, message),
      onSent: (_engine, _ids, ok) => metrics.heartbeats.inc({ outcome: ok ? 'ok' : 'failed' }),
    })
    this.#sender.start()
    this.#routerLink = config.routerUrl
      ? new RouterLink({
          urls: config.routerUrl.split(','),
          agentId: this.agentId,
          ...(config.agentToken ? { token: config.agentToken } : {}),
          clock,
          random: deps.random,
          log: log.child({ component: 'router-link' }),
          target: { peerGone: (req) => this.peerGone(req), release: (id) => this.release(id), peerAlive: (ids) => this.#peers.revive(ids) },
          metrics: { events: metrics.routerEvents, connected: metrics.routerConnected },
        })
      : undefined
    if (config.unsafeSkipDeadlineChecks) log.warn('UNSAFE: lease deadline checks are OFF (test switch); stale KV will be decoded')
  }

  /** host:port that peers are told to dial (what a handshake proof must name). */
  get peerAddress(): string {
    const { host, port } = this.#d.peerAddress()
    return `${host}:${port}`
  }

  get attachment(): Attachment | undefined {
    return this.#attachment
  }

  /**
   * The engine names its KV region. The same attach again is a no-op; another engine_id
   * (the engine restarted) replaces the attachment: its leases end, its NIXL agent closes
   * once its READs are quiescent, and peers see a new NIXL agent name. A region outside the
   * configured prefix, or one another agent holds, is refused before anything changes: the
   * engine attached now keeps its region and its leases.
   */
  async attach(req: AgentAttach): Promise<AgentAttached> {
    if (this.#closed) throw xfaError('XFA_ERR_SHUTTING_DOWN', 'the agent is closing')
    const prefix = this.#d.config.shmPrefix
    if (!req.shmName.startsWith(prefix)) {
      throw xfaError('XFA_ERR_ATTACH_REFUSED', `${req.shmName} is not under this agent's shared-memory prefix ${prefix} (--shm-prefix)`, { engineId: req.engineId })
    }
    while (this.#attaching) await this.#attaching.catch(() => undefined)
    const current = this.#attachment
    if (!current || !current.sameAs(req)) {
      this.#attaching = this.#replace(current, req)
      try {
        await this.#attaching
      } finally {
        this.#attaching = undefined
      }
    }
    const { host, port } = this.#d.peerAddress()
    // Registers with the router (again when the engine_id or its URL changed).
    this.#routerLink?.attached({
      engineId: req.engineId,
      role: req.role,
      agentUrl: `http://${hostPort(host, port)}`,
      ...(req.engineUrl && /^https?:\/\//.test(req.engineUrl) ? { engineUrl: req.engineUrl } : {}),
    })
    return { agentId: this.agentId, engineId: req.engineId, peerHost: host, peerPort: port, leaseSeconds: this.#d.config.leaseSeconds }
  }

  async #replace(old: Attachment | undefined, req: AgentAttach): Promise<Attachment> {
    const { log, metrics, clock } = this.#d
    // Another region is opened (and locked) first, so a refused or failed one ends nothing.
    // The same region (an engine restarted with a fixed name) is ours: let go of it, then
    // take it again.
    const opened = old && old.request.shmName !== req.shmName ? await Attachment.open(req) : undefined
    if (old) {
      this.#attachment = undefined
      const ended = this.#leases?.releaseAll() ?? 0
      this.#leases?.stop()
      this.#leases = undefined
      log.warn({ old: old.engineId, engineId: req.engineId, leasesEnded: ended }, 'engine re-attached with another region or engine_id: closing the old NIXL agent')
      await old.close()
    }
    const att = opened ?? (await Attachment.open(req))
    att.nixl.on('notification', (n: Notification) => this.#notification(n))
    const leases = new PrefillLeases({
      clock,
      leaseMs: this.#leaseMs,
      numBlocks: req.numBlocks,
      // Heartbeats the NIXL thread already received are applied before a lease is reaped.
      deferReap: setImmediate,
      onEnd: (requestId, blockIds, reason) => {
        metrics.leasesEnded.inc({ reason })
        metrics.leases.set(this.#leases?.size ?? 0)
        if (reason === 'expired') log.warn({ requestId, blocks: blockIds.length }, 'KV lease expired unread: blocks freed')
        this.events.push({ type: 'lease_ended', requestId, blockIds: [...blockIds], reason })
        metrics.engineEventsPending.set(this.events.pending)
      },
    })
    leases.start()
    this.#leases = leases
    this.#attachment = att
    log.info({ engineId: req.engineId, role: req.role, shm: req.shmName, blocks: req.numBlocks, blockBytes: att.blockBytes }, 'engine attached')
    return att
  }

  /** Prefiller: hold `blockIds` for `requestId`; the deadline is exported by the engine. */
  lease(requestId: string, blockIds: readonly number[], consumers?: number): LeaseGranted {
    const leases = this.#requireLeases()
    const expiresAt = leases.lease(requestId, blockIds, consumers)
    this.#d.metrics.leases.set(leases.size)
    return { requestId, expiresAt, leaseSeconds: this.#d.config.leaseSeconds }
  }

  release(requestId: string): boolean {
    return this.#requireLeases().release(requestId)
  }

  /** Decoder: the engine will pull P's request later; heartbeats start now (pulls.ts, expectations). */
  expect(req: PullExpected): PullExpectation {
    if (this.#closed) throw xfaError('XFA_ERR_SHUTTING_DOWN', 'the agent is closing')
    return this.#puller.expect(req)
  }

  /** Decoder: READ a prefiller's blocks into local ones. Rejects with a PullFailure. */
  pull(req: PullRequest, signal: AbortSignal): Promise<PullDone> {
    if (this.#closed) return Promise.reject({ error: xfaError('XFA_ERR_SHUTTING_DOWN', 'the agent is closing'), invalidBlockIds: [], tainted: false })
    return this.#puller.pull(req, signal)
  }

  /** What a peer's handshake learns: metadata, engine_id, clock reading, region layout. */
  handshakeAnswer(): PeerHandshake {
    const att = this.#requireAttached()
    return {
      engineId: att.engineId,
      agentId: this.agentId,
      metadata: att.metadata.toString('base64'),
      clock: this.#d.clock.monotonic() / 1000,
      probe: true,
      region: { addr: att.registration.addr.toString(), len: att.registration.len, blockBytes: att.blockBytes, numBlocks: att.numBlocks },
    }
  }

  /** The router's peer_gone (idempotent; unknown peers are a no-op). */
  /** Whether `engineId` was declared gone and still fails fast here. */
  isGone(engineId: string): boolean {
    return this.#peers.isGone(engineId)
  }

  async peerGone(req: PeerGoneRequest): Promise<void> {
    this.#d.log.info({ engineIds: req.engineIds, addresses: req.addresses, reason: req.reason }, 'peer_gone')
    await this.#peers.peerGone({ ...(req.engineIds ? { engineIds: req.engineIds } : {}), ...(req.addresses ? { addresses: req.addresses } : {}) })
  }

  /** Gauges that are cheaper to read on scrape than to keep current. */
  refreshGauges(): void {
    const { metrics } = this.#d
    const states = { handshaking: 0, ready: 0, releasing: 0 }
    for (const p of this.#peers.peers()) states[p.state]++
    for (const [state, n] of Object.entries(states)) metrics.peers.set({ state }, n)
    metrics.taintedBlocks.set(this.#puller.taintedBlocks)
    metrics.leases.set(this.#leases?.size ?? 0)
    metrics.engineEventsPending.set(this.events.pending)
  }

  status(): Record<string, unknown> {
    const att = this.#attachment
    return {
      agentId: this.agentId,
      engineId: att?.engineId ?? null,
      role: att?.role ?? null,
      leases: this.#leases?.size ?? 0,
      pullsInFlight: this.#puller.inFlight,
      pullsExpected: this.#puller.expected,
      taintedBlocks: this.#puller.taintedBlocks,
      peers: this.#peers.peers(),
      nixl: att ? att.nixl.stats() : null,
      router: this.#routerLink?.status() ?? null,
    }
  }

  async close(): Promise<void> {
    if (this.#closed) return
    this.#closed = true
    this.#sender.stop()
    this.#puller.clearExpected()
    this.#leases?.stop()
    await this.#routerLink?.close()
    await this.#attaching?.catch(() => undefined)
    // The NIXL agent cancels READs and waits for them before it deregisters and unmaps.
    await this.#attachment?.close()
    await this.#handshake.close()
  }

  #settled(r: PullReport): void {
    const { metrics, log } = this.#d
    metrics.pulls.inc({ outcome: r.outcome })
    if (r.noExpiry) metrics.pullsWithoutExpiry.inc()
    if (r.expired) metrics.kvExpired.inc({ reason: r.expired.reason, check: r.expired.at })
    if (r.outcome === 'ok') {
      metrics.readBytes.inc(r.bytes)
      if (r.readMicros !== undefined) metrics.readSeconds.observe(r.readMicros / 1e6)
      if (r.beforeReadMs !== undefined) metrics.beforeReadSeconds.observe(r.beforeReadMs / 1000)
      metrics.pullSeconds.observe(r.pullMs / 1000)
      log.debug({ requestId: r.requestId, peer: r.remoteEngineId, bytes: r.bytes, pullMs: r.pullMs }, 'pull done')
      return
    }
    log.warn({ requestId: r.requestId, peer: r.remoteEngineId, outcome: r.outcome, expired: r.expired, tainted: r.tainted, pullMs: r.pullMs }, 'pull failed')
  }

  /**
   * A failed pull is quiescent: D's word to P that it is done with the blocks (`GU:<P id>`,
   * counted as one consumer done, like vLLM's read-done after a READ), so P frees them now
   * instead of at its lease's end. Only the decoder may end a lease it was handed early
   * (DESIGN "Who may end a lease early"); a P that is gone or not loaded hears nothing.
   */
  #gaveUp(engineId: string, remoteRequestId: string): void {
    const att = this.#attachment
    if (!att?.nixl.peers().some((p) => p.engineId === engineId)) return
    att.nixl.genNotif(engineId, `GU:${remoteRequestId}`).then(
      () => this.#d.metrics.gaveUp.inc({ outcome: 'ok' }),
      (err: unknown) => {
        this.#d.metrics.gaveUp.inc({ outcome: 'failed' })
        this.#d.log.debug({ err, peer: engineId, remoteRequestId }, 'telling the prefiller a failed pull is over failed; its lease ends at expiry')
      },
    )
  }

  #notification(n: Notification): void {
    const parsed = parsePrefillNotification(n.message.toString('utf8'))
    const leases = this.#leases
    if (!parsed || !leases) return
    if (parsed.kind === 'heartbeat') {
      const { extended, unknown } = leases.heartbeat(parsed.ids)
      this.#d.metrics.heartbeatsReceived.inc({ result: 'extended' }, extended)
      if (unknown > 0) this.#d.metrics.heartbeatsReceived.inc({ result: 'unknown' }, unknown)
    } else if (parsed.kind === 'gave_up') {
      // A lease that already ended (expired: why the pull failed) is fine to hear of.
      leases.readDone(parsed.id)
    } else if (!leases.readDone(parsed.id)) {
      // vLLM's words for it: a decoder finished a READ of blocks no lease holds any more (a
      // second read of a one-read lease, or one after expiry), so it may have read reused KV.
      this.#d.metrics.readDoneUnknown.inc()
      this.#d.log.warn({ requestId: parsed.id }, 'Potentially invalid KV blocks for unrecognized request were retrieved by a decode worker')
    }
  }

  #requireAttached(): Attachment {
    const att = this.#attachment
    if (!att) throw xfaError('XFA_ERR_NOT_ATTACHED', 'no engine has attached to this agent')
    return att
  }

  #requireLeases(): PrefillLeases {
    const leases = this.#leases
    if (!leases) throw xfaError('XFA_ERR_NOT_ATTACHED', 'no engine has attached to this agent')
    return leases
  }
}

/** The peer plane's key: the peer secret, else the agent token (one secret for both planes). */
export function agentPeerKey(config: Pick<AgentConfig, 'peerSecret' | 'agentToken'>): Buffer | undefined {
  const secret = config.peerSecret ?? config.agentToken
  return secret === undefined ? undefined : peerKey(secret)
}
