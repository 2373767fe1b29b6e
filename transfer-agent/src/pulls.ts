import type { Clock, ClockTimer } from '../../common/clock.js'
import { isTainted, type PreparedBlocks } from '../../native/index.js'
import type { PullDone, PullExpected, PullRequest } from '../../schemas/agent-api.js'
import { checkLease, toLocalExpiry, type LeaseDeclineReason, type LocalExpiry } from './deadline.js'
import { isXfaError, xfaError, type XfaError, type XfaErrorCode } from './errors.js'
import type { HeartbeatRegistry } from './heartbeats.js'
import type { PeerLease, PeerRegion, PeerTable } from './peers.js'

/**
 * The decoder's pull (DESIGN "Transfer agent"): one engine request's blocks READ from a
 * prefiller, under P's lease. In order:
 * 1. check the request against the attached region (ids in range, one pull per request id)
 *    and that it names P's lease expiry (unless allowNoExpiry);
 * 2. start the heartbeat record (heartbeats are due from here until the READ is done);
 * 3. take a peer lease (handshake once per engine_id), prepare P's region once per handshake;
 * 4. check P's lease on our clock, post the READ, and check again when it completes, so a
 *    lease that ran out while the READ was in flight is caught too;
 * 5. on any failure, report every destination block invalid; a READ that may still write
 *    (tainted) keeps them out of the engine's hands until the native gate says it is quiescent.
 * The native agent, peer table, heartbeats and clock are injected; nothing here does I/O.
 *
 * An *expectation* (`expect`, issue 17 item 4) is the engine saying it has a request it will
 * pull but not yet: vLLM's scheduler heartbeats a request from the moment it reaches D, not
 * from its READ, so time D spends queueing is credited; started only at the pull, the chain
 * would break at a 5 s lease as soon as D waits a second. The record starts then (and the
 * handshake, so heartbeats can go out), lives while the engine says it again within
 * `expectTtlMs` (it stops when the engine stalls or drops the request, as vLLM's do), and the
 * pull takes it over.
 */

/** What a pull needs from the attached engine's NIXL side (attachment.ts, or a fake). */
export interface PullTarget {
  readonly numBlocks: number
  readonly blockBytes: number
  /** The local region prepared as blocks. */
  readonly blocks: PreparedBlocks
  readonly nixl: {
    prepareRemoteBlocks(engineId: string, region: { addr: bigint; len: number }, blockBytes: number): Promise<PreparedBlocks>
    readBlocks(
      engineId: string,
      local: PreparedBlocks,
      localIdx: readonly number[],
      remote: PreparedBlocks,
      remoteIdx: readonly number[],
      opts: { notif?: string; timeoutMs?: number; signal?: AbortSignal },
    ): Promise<{ bytes: number; micros: number }>
  }
}

export type PullOutcome = 'ok' | 'kv_expired' | 'peer_gone' | 'disconnected' | 'handshake_failed' | 'read_failed' | 'canceled' | 'invalid'

export interface PullReport {
  requestId: string
  remoteEngineId: string
  outcome: PullOutcome
  /** Where the lease check declined (kv_expired only). */
  expired?: { reason: LeaseDeclineReason; at: 'before_read' | 'after_read' }
  bytes: number
  /** Accepted → READ posted, ms (the agent's own overhead before the READ). */
  beforeReadMs: number | undefined
  /** READ time reported by NIXL, µs. */
  readMicros: number | undefined
  pullMs: number
  tainted: boolean
  /** Read with no lease check: P exported no expiry (allowNoExpiry only). */
  noExpiry: boolean
}

export interface PullerOptions {
  clock: Clock
  peers: PeerTable
  heartbeats: HeartbeatRegistry
  /** The attached engine, or undefined before attach. */
  target: () => PullTarget | undefined
  /** D's kv_lease_duration, ms: caps the margin (must equal P's). */
  leaseMs: number
  safetyMs: number
  readTimeoutMs: number
  /** False only for the test switch that proves the scenario tests can see stale reads. */
  checkDeadlines: boolean
  /**
   * Read a pull that names no lease expiry (P exported none) with no lease check; without
   * this such a pull is refused, since nothing says P still holds the blocks (issue 18).
   */
  allowNoExpiry?: boolean
  /** Once per failed pull, when its destination blocks may be reused (after quiescence). */
  onQuiesced: (requestId: string, blockIds: readonly number[]) => void
  /**
   * Once per accepted pull that failed, once nothing of it can still read P's blocks: D's own
   * word that it is done with them (the agent tells P, which frees them before its lease
   * runs out). Never for a pull refused before it started (it may be a duplicate).
   */
  onGaveUp?: (remoteEngineId: string, remoteRequestId: string) => void
  /** Once per pull, when it settles (metrics, logs); must not throw. */
  onSettled?: (report: PullReport) => void
  /** An expectation's handshake is loaded: its first heartbeat may go now. */
  onPeerReady?: (engineId: string) => void
  /** How long an expectation heartbeats without being said again, ms (default lease/2). */
  expectTtlMs?: number
  /** Expectations held at once (default 4096); more are refused (XFA_ERR_TOO_MANY_PULLS). */
  maxExpected?: number
}

/** A failed pull, as the API answers it. */
export interface PullFailure {
  error: XfaError
  invalidBlockIds: number[]
  tainted: boolean
}

export function isPullFailure(x: unknown): x is PullFailure {
  return typeof x === 'object' && x !== null && isXfaError((x as PullFailure).error) && Array.isArray((x as PullFailure).invalidBlockIds)
}

const OUTCOME: Partial<Record<XfaErrorCode, PullOutcome>> = {
  XFA_ERR_KV_EXPIRED: 'kv_expired',
  XFA_ERR_PEER_GONE: 'peer_gone',
  XFA_ERR_PEER_DISCONNECTED: 'disconnected',
  XFA_ERR_HANDSHAKE_FAILED: 'handshake_failed',
  XFA_ERR_ENGINE_ID_MISMATCH: 'handshake_failed',
  XFA_ERR_READ_FAILED: 'read_failed',
  XFA_ERR_PULL_CANCELED: 'canceled',
}

export class Puller {
  readonly #o: PullerOptions
  /** Decoder request ids with a pull in flight. */
  readonly #inFlight = new Set<string>()
  /** P's region prepared once per handshake (keyed by that handshake's metadata buffer). */
  readonly #remoteLists = new WeakMap<Buffer, Promise<PreparedBlocks>>()
  #taintedBlocks = 0
  /** Expectations not yet taken over by their pull: `<engine>\0<request>` → lapse timer. */
  readonly #expected = new Map<string, ClockTimer>()
  /** When each peer's clock was last sampled again as suspect (monotonic ms). */
  readonly #clockSuspected = new Map<string, number>()

  constructor(opts: PullerOptions) {
    this.#o = opts
  }

  get inFlight(): number {
    return this.#inFlight.size
  }

  /** Destination blocks of failed READs that NIXL has not yet confirmed done. */
  get taintedBlocks(): number {
    return this.#taintedBlocks
  }

  /** Expectations heartbeating now, before their pull. */
  get expected(): number {
    return this.#expected.size
  }

  /**
   * The engine will pull P's `remoteRequestId` (see the class comment): heartbeats start now,
   * or go on, for `expectTtlMs` more; the handshake starts if none is cached. A pull of it
   * already in flight heartbeats anyway: nothing to do.
   */
  expect(req: PullExpected): { ttlMs: number } {
    const o = this.#o
    const ttlMs = o.expectTtlMs ?? o.leaseMs / 2
    const key = `${req.remoteEngineId}\0${req.remoteRequestId}`
    const held = this.#expected.get(key)
    if (held) o.clock.clearTimeout(held)
    else if (o.heartbeats.get(req.remoteEngineId, req.remoteRequestId)) return { ttlMs }
    else {
      if (this.#expected.size >= (o.maxExpected ?? 4096)) throw xfaError('XFA_ERR_TOO_MANY_PULLS', `${this.#expected.size} expectations held`)
      o.heartbeats.start(req.remoteEngineId, req.remoteRequestId)
      // Heartbeats go out only once a handshake is loaded: have one ready before the pull.
      void o.peers.acquire(req.remoteEngineId, `${req.remoteHost}:${req.remotePort}`).then(
        (peer) => {
          peer.release()
          o.onPeerReady?.(req.remoteEngineId)
        },
        () => undefined,
      )
    }
    const timer = o.clock.setTimeout(() => {
      // Not said again: the engine stalled or dropped it, and heartbeats stop, as vLLM's would.
      if (this.#expected.get(key) !== timer) return
      this.#expected.delete(key)
      o.heartbeats.end(req.remoteEngineId, req.remoteRequestId)
    }, ttlMs)
    timer.unref?.()
    this.#expected.set(key, timer)
    return { ttlMs }
  }

  /** Ends every expectation (the agent is closing). */
  clearExpected(): void {
    for (const [key, timer] of this.#expected) {
      this.#o.clock.clearTimeout(timer)
      const [engineId, requestId] = key.split('\0') as [string, string]
      this.#o.heartbeats.end(engineId, requestId)
    }
    this.#expected.clear()
  }

  /** Resolves when the bytes are in place; rejects with a PullFailure. */
  async pull(req: PullRequest, signal: AbortSignal): Promise<PullDone> {
    const o = this.#o
    const started = o.clock.monotonic()
    const target = o.target()
    const key = `${req.remoteEngineId}\0${req.remoteRequestId}`
    const refused = !target
      ? xfaError('XFA_ERR_NOT_ATTACHED', 'attach the engine before pulling')
      : this.#inFlight.has(req.requestId)
        ? xfaError('XFA_ERR_PULL_EXISTS', req.requestId)
        : o.heartbeats.get(req.remoteEngineId, req.remoteRequestId) && !this.#expected.has(key)
          ? xfaError('XFA_ERR_PULL_EXISTS', `remote request ${req.remoteRequestId} is being pulled by another request`)
          : (validate(req, target) ?? this.#noExpiry(req))
    if (refused || !target) {
      // Nothing was read: the engine may reuse the blocks at once (one event per failed pull),
      // except for a duplicate of a pull in flight, whose event would name the other pull.
      if (!this.#inFlight.has(req.requestId)) o.onQuiesced(req.requestId, req.localBlockIds)
      throw failure(refused ?? xfaError('XFA_ERR_NOT_ATTACHED', 'no engine'), [...req.localBlockIds], false)
    }
    this.#inFlight.add(req.requestId)
    const expectation = this.#expected.get(key)
    if (expectation !== undefined) {
      // Its expectation's record goes on, unbroken: the chain D built while it waited.
      o.clock.clearTimeout(expectation)
      this.#expected.delete(key)
    } else o.heartbeats.start(req.remoteEngineId, req.remoteRequestId)
    const report: PullReport = {
      requestId: req.requestId,
      remoteEngineId: req.remoteEngineId,
      outcome: 'ok',
      bytes: 0,
      beforeReadMs: undefined,
      readMicros: undefined,
      pullMs: 0,
      tainted: false,
      noExpiry: req.remoteBlocksExpiryTime === null,
    }
    let peer: PeerLease | undefined
    let expiry: LocalExpiry | undefined
    try {
      peer = await o.peers.acquire(req.remoteEngineId, `${req.remoteHost}:${req.remotePort}`)
      if (signal.aborted) throw xfaError('XFA_ERR_PULL_CANCELED', 'the engine went away during the handshake')
      const remote = await this.#remoteList(target, peer)
      const outOfRange = req.remoteBlockIds.find((b) => b >= remote.count)
      if (outOfRange !== undefined) throw xfaError('XFA_ERR_INVALID_ARG', `remote block ${outOfRange} outside the peer's ${remote.count} blocks`)
      expiry = req.remoteBlocksExpiryTime === null ? undefined : toLocalExpiry(req.remoteBlocksExpiryTime, peer.clock)

      this.#check(req, expiry, 'before_read', report)
      report.beforeReadMs = o.clock.monotonic() - started
      const result = await this.#read(target, remote, req, peer, signal)
      report.readMicros = result.micros
      this.#check(req, expiry, 'after_read', report)
      report.bytes = result.bytes
      report.pullMs = o.clock.monotonic() - started
      return { requestId: req.requestId, bytes: result.bytes, readMicros: result.micros, pullMicros: report.pullMs * 1000 }
    } catch (err) {
      const f = isPullFailure(err) ? err : this.#failure(err, req, peer)
      if (peer && expiry && report.expired?.at === 'before_read' && expiry.e0 <= started) this.#suspectClock(peer)
      report.outcome = OUTCOME[f.error.code] ?? 'invalid'
      report.tainted = f.tainted
      report.pullMs = o.clock.monotonic() - started
      throw f
    } finally {
      o.heartbeats.end(req.remoteEngineId, req.remoteRequestId)
      peer?.release()
      this.#inFlight.delete(req.requestId)
      try {
        o.onSettled?.(report)
      } catch {
        // Metrics and logs must not change a pull's answer.
      }
    }
  }

  /**
   * P's deadline was already past when this pull arrived. Either the pull waited somewhere
   * (a paused decoder, a slow router), or the clock reading of the cached handshake no longer
   * fits P: its agent restarted on another clock epoch (another host, a reboot) under the same
   * engine_id, and every later lease would look expired too. The peer table samples the clock
   * again beside the cached handshake, which stays: READs in flight on it are healthy and must
   * not fail for one late pull (issue 17 item 2). At most once per half lease per peer, so a
   * burst of late pulls costs one sample.
   */
  #suspectClock(peer: PeerLease): void {
    const now = this.#o.clock.monotonic()
    for (const [id, at] of this.#clockSuspected) if (now - at >= this.#o.leaseMs / 2) this.#clockSuspected.delete(id)
    const last = this.#clockSuspected.get(peer.engineId)
    if (last !== undefined && now - last < this.#o.leaseMs / 2) return
    this.#clockSuspected.set(peer.engineId, now)
    void this.#o.peers.resampleClock(peer.engineId)
  }

  /** A pull with no expiry to check, unless the agent was told to accept those. */
  #noExpiry(req: PullRequest): XfaError | undefined {
    if (req.remoteBlocksExpiryTime !== null || this.#o.allowNoExpiry) return undefined
    return xfaError('XFA_ERR_NO_LEASE_EXPIRY', `${req.remoteEngineId}/${req.remoteRequestId}: the prefiller exported no remote_blocks_expiry_time (start the agent with --allow-no-expiry to read such pulls unchecked)`, {
      engineId: req.remoteEngineId,
    })
  }

  /** The lease check; a decline throws XFA_ERR_KV_EXPIRED with the reason. */
  #check(req: PullRequest, expiry: LocalExpiry | undefined, at: 'before_read' | 'after_read', report: PullReport): void {
    const o = this.#o
    if (!expiry || !o.checkDeadlines) return
    const verdict = checkLease(o.clock.monotonic(), {
      expiry,
      heartbeats: o.heartbeats.get(req.remoteEngineId, req.remoteRequestId),
      leaseMs: o.leaseMs,
      safetyMs: o.safetyMs,
    })
    if (verdict.ok) return
    report.expired = { reason: verdict.reason, at }
    const late = Math.round(o.clock.monotonic() - verdict.deadline)
    throw xfaError('XFA_ERR_KV_EXPIRED', `${req.remoteEngineId}/${req.remoteRequestId}: ${verdict.reason} ${at.replace('_', ' ')}, ${late} ms past the deadline`, {
      engineId: req.remoteEngineId,
    })
  }

  #remoteList(target: PullTarget, peer: PeerLease): Promise<PreparedBlocks> {
    let list = this.#remoteLists.get(peer.metadata)
    if (!list) {
      const region = peer.region
      list = region ? prepare(target, peer.engineId, region) : Promise.reject(xfaError('XFA_ERR_HANDSHAKE_FAILED', `${peer.engineId} sent no KV region`, { engineId: peer.engineId }))
      // A failed prepare is not cached: the next pull tries again.
      list.catch(() => this.#remoteLists.delete(peer.metadata))
      this.#remoteLists.set(peer.metadata, list)
    }
    return list
  }

  async #read(target: PullTarget, remote: PreparedBlocks, req: PullRequest, peer: PeerLease, signal: AbortSignal): Promise<{ bytes: number; micros: number }> {
    // One signal for the READ: the engine going away, or the peer being dropped meanwhile.
    const abort = new AbortController()
    const onAbort = (): void => abort.abort(signal.aborted ? signal.reason : peer.signal.reason)
    if (signal.aborted || peer.signal.aborted) onAbort()
    signal.addEventListener('abort', onAbort, { once: true })
    peer.signal.addEventListener('abort', onAbort, { once: true })
    try {
      return await target.nixl.readBlocks(peer.engineId, target.blocks, req.localBlockIds, remote, req.remoteBlockIds, {
        // P frees the blocks when this arrives: vLLM's read-done message, `<P id>:<consumers>`.
        notif: `${req.remoteRequestId}:1`,
        timeoutMs: this.#o.readTimeoutMs,
        signal: abort.signal,
      })
    } finally {
      signal.removeEventListener('abort', onAbort)
      peer.signal.removeEventListener('abort', onAbort)
    }
  }

  /** An accepted pull's failure is quiescent: the engine may reuse its blocks, P may free its own. */
  #quiesced(req: PullRequest, blocks: readonly number[]): void {
    this.#o.onQuiesced(req.requestId, blocks)
    this.#o.onGaveUp?.(req.remoteEngineId, req.remoteRequestId)
  }

  /** Any failure of an accepted pull → the coded answer; taints and disconnects handled once here. */
  #failure(err: unknown, req: PullRequest, peer: PeerLease | undefined): PullFailure {
    const blocks = [...req.localBlockIds]
    if (isXfaError(err)) {
      this.#quiesced(req, blocks)
      return failure(err, blocks, false)
    }
    const e = err as { code?: string; message?: string }
    if (e.code === 'NAT_ERR_REMOTE_DISCONNECT' || e.code === 'NAT_ERR_PEER_UNKNOWN') peer?.markDisconnected()
    let code: XfaErrorCode = 'XFA_ERR_READ_FAILED'
    if (e.code === 'NAT_ERR_XFER_CANCELED' || e.code === 'NAT_ERR_AGENT_CLOSED') code = 'XFA_ERR_PULL_CANCELED'
    if (peer?.signal.aborted) code = isXfaError(peer.signal.reason) ? peer.signal.reason.code : code
    const error = xfaError(code, `${req.remoteEngineId}/${req.remoteRequestId}: ${e.code ?? ''} ${e.message ?? String(err)}`.trim(), {
      engineId: req.remoteEngineId,
      cause: err,
    })
    if (isTainted(err)) {
      // Bytes may still land in these blocks: the engine gets them back only once NIXL says done.
      this.#taintedBlocks += blocks.length
      void err.quiesced.then(() => {
        this.#taintedBlocks -= blocks.length
        this.#quiesced(req, blocks)
      })
      return failure(error, blocks, true)
    }
    this.#quiesced(req, blocks)
    return failure(error, blocks, false)
  }
}

function failure(error: XfaError, invalidBlockIds: number[], tainted: boolean): PullFailure {
  return { error, invalidBlockIds, tainted }
}

function prepare(target: PullTarget, engineId: string, region: PeerRegion): Promise<PreparedBlocks> {
  if (region.blockBytes !== target.blockBytes) {
    return Promise.reject(
      xfaError('XFA_ERR_HANDSHAKE_FAILED', `${engineId} has ${region.blockBytes}-byte blocks, this engine ${target.blockBytes}`, { engineId }),
    )
  }
  return target.nixl.prepareRemoteBlocks(engineId, { addr: region.addr, len: region.numBlocks * region.blockBytes }, region.blockBytes)
}

/** What is wrong with the request for this region, or undefined. */
function validate(req: PullRequest, target: PullTarget): XfaError | undefined {
  const bad = (detail: string): XfaError => xfaError('XFA_ERR_INVALID_ARG', detail)
  if (req.localBlockIds.length !== req.remoteBlockIds.length) {
    return bad(`${req.localBlockIds.length} local blocks for ${req.remoteBlockIds.length} remote blocks`)
  }
  const seen = new Set<number>()
  for (const b of req.localBlockIds) {
    if (b >= target.numBlocks) return bad(`local block ${b} outside the region (0..${target.numBlocks - 1})`)
    if (seen.has(b)) return bad(`local block ${b} listed twice`)
    seen.add(b)
  }
  return undefined
}
