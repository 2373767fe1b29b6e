import type { Clock } from '../../common/clock.js'
import { deferred, type Deferred } from '../../common/deferred.js'
import type { ClockSample } from './deadline.js'
import { xfaError, type XfaError } from './errors.js'

/**
 * The decoder's peer table (DESIGN "Transfer agent" → Handshake, Peer cleanup): which
 * prefill engines this agent has handshaken with, how many READs each has in flight, and when
 * each one's NIXL state may be released. No I/O of its own: the handshake, the native gate and
 * the clock are injected, so every rule and race below is unit-tested with fakes.
 *
 * One *generation* is one handshake's result for one engine_id: it is either handshaking, ready
 * (cached), or dropped. A dropped generation is released from the gate (`forgetPeer`) once no
 * READ and no handshake step of it is in flight, exactly once, and only if the gate loaded it.
 */

/** What a handshake answers: the peer's NIXL metadata, identity and clock reading. */
export interface HandshakeResult {
  readonly engineId: string
  readonly metadata: Buffer
  readonly clock: ClockSample
  /** The peer advertised the disconnect probe (it runs our addon); passed to `loadPeer`. */
  readonly probe?: boolean
  /** The peer's KV region, for preparing its blocks once per handshake. */
  readonly region?: PeerRegion
}

/** Where a peer's KV blocks are in its address space (from the handshake). */
export interface PeerRegion {
  readonly addr: bigint
  readonly len: number
  readonly blockBytes: number
  readonly numBlocks: number
}

/**
 * Fetches a peer's metadata from `address`. `expectedEngineId` is the `remote_engine_id` the
 * pull names (the table checks the answer against it too). The signal aborts when the peer
 * is released while the handshake is in flight. Its own deadline is the handshake's business.
 */
export type Handshake = (address: string, expectedEngineId: string, signal: AbortSignal) => Promise<HandshakeResult>

/** The part of the native gate (native/agent.ts `NixlAgent`) the table drives. */
export interface PeerGate {
  loadPeer(engineId: string, md: Buffer, opts?: { probe?: boolean }): Promise<unknown>
  /** Fails new READs to the peer at once, waits for those in flight, invalidates it. */
  forgetPeer(engineId: string): Promise<void>
}

export type PeerReleaseReason = 'peer_gone' | 'engine_id_changed' | 'disconnect' | 'stale_clock'

/** Reported once per dropped generation, after its NIXL state was released. */
export interface PeerRelease {
  readonly engineId: string
  readonly address: string
  readonly reason: PeerReleaseReason
  /** Whether the gate had loaded it (and `forgetPeer` was called). */
  readonly loaded: boolean
  /** `forgetPeer`'s rejection, if it rejected (the generation is dropped all the same). */
  readonly error?: unknown
}

/**
 * Held by one READ from before it is posted until it settles (quiescent or tainted): while
 * any lease of a peer is held, its NIXL state stays loaded.
 */
export interface PeerLease {
  readonly engineId: string
  readonly address: string
  readonly metadata: Buffer
  readonly clock: ClockSample
  readonly probe: boolean
  readonly region: PeerRegion | undefined
  /**
   * Aborts (reason: XFA_ERR_PEER_GONE or XFA_ERR_PEER_DISCONNECTED) when the peer is dropped
   * while this lease is held: check it before posting; passing it to the READ cancels it.
   */
  readonly signal: AbortSignal
  /** Ends this lease; idempotent. */
  release(): void
  /**
   * This READ failed with a remote disconnect, or the peer's clock reading no longer fits
   * its deadlines ('stale_clock'): drops this lease's handshake if still cached, so the next
   * acquire handshakes (and samples the clock) again.
   */
  markDisconnected(reason?: 'disconnect' | 'stale_clock'): boolean
}

export interface PeerGoneTarget {
  engineIds?: readonly string[]
  addresses?: readonly string[]
}

export type PeerState = 'handshaking' | 'ready' | 'releasing'

export interface PeerSnapshot {
  readonly engineId: string
  readonly address: string
  readonly state: PeerState
  readonly reads: number
}

export interface PeerTableOptions {
  handshake: Handshake
  gate: PeerGate
  clock: Clock
  /** Called once per dropped generation after its release (metrics, logs); must not throw. */
  onRelease?: (release: PeerRelease) => void
  /** How long a gone engine_id keeps failing fast, ms (default 10 min, monotonic clock). */
  tombstoneTtlMs?: number
  /** How many gone engine_ids are remembered (default 4096); the oldest go first. */
  maxTombstones?: number
}

export const DEFAULT_TOMBSTONE_TTL_MS = 10 * 60_000
export const DEFAULT_MAX_TOMBSTONES = 4096

/** A deferred nobody may wait on (a peer dropped with no acquire pending): never unhandled. */
function quietDeferred<T>(): Deferred<T> {
  const d = deferred<T>()
  d.promise.catch(() => undefined)
  return d
}

interface Generation {
  readonly engineId: string
  readonly address: string
  /** Settles when the handshake and load are done: ready, or rejected with the failure. */
  readonly ready: Deferred<void>
  /** Resolves once the generation is dropped and its NIXL state released. */
  readonly released: Deferred<void>
  /** Handshake signal and lease signal; aborts when the generation is dropped. */
  readonly abort: AbortController
  answer: HandshakeResult | undefined
  state: 'handshaking' | 'ready'
  reads: number
  /** The handshake or load of this generation is still running. */
  running: boolean
  /** gate.loadPeer resolved for it: forgetPeer is owed. */
  loaded: boolean
  dropped: { reason: PeerReleaseReason; error: XfaError } | undefined
  finalizing: boolean
  /** A clock sample taken again beside this handshake (resampleClock), while it runs. */
  resampling: Promise<boolean> | undefined
}

/**
 * Peers by engine_id. `acquire` hands out a lease per READ, handshaking first when the
 * engine_id is not cached (one handshake per engine_id, shared by concurrent acquires);
 * `peerGone`, `markDisconnected` and a new engine_id at a known address drop peers.
 */
export class PeerTable {
  readonly #handshake: Handshake
  readonly #gate: PeerGate
  readonly #clock: Clock
  readonly #onRelease: ((release: PeerRelease) => void) | undefined
  readonly #tombstoneTtlMs: number
  readonly #maxTombstones: number
  /** The current generation per engine_id (handshaking or cached). */
  readonly #peers = new Map<string, Generation>()
  /** Dropped generations whose NIXL state is not released yet. */
  readonly #releasing = new Map<string, Set<Generation>>()
  /** The engine_id whose handshake last succeeded at each address. */
  readonly #byAddress = new Map<string, string>()
  /** Gone engine_id → when (monotonic ms); insertion order is age order. */
  readonly #tombstones = new Map<string, number>()

  constructor(opts: PeerTableOptions) {
    const ttl = opts.tombstoneTtlMs ?? DEFAULT_TOMBSTONE_TTL_MS
    const max = opts.maxTombstones ?? DEFAULT_MAX_TOMBSTONES
    if (!(ttl > 0)) throw xfaError('XFA_ERR_INVALID_ARG', `tombstoneTtlMs must be positive, got ${ttl}`)
    if (!(Number.isInteger(max) && max > 0)) throw xfaError('XFA_ERR_INVALID_ARG', `maxTombstones must be a positive integer, got ${max}`)
    this.#handshake = opts.handshake
    this.#gate = opts.gate
    this.#clock = opts.clock
    this.#onRelease = opts.onRelease
    this.#tombstoneTtlMs = ttl
    this.#maxTombstones = max
  }

  /**
   * A lease on peer `engineId` for one READ. Handshakes with `address` unless the engine_id
   * is cached (then `address` is not used). Rejects with XFA_ERR_PEER_GONE (a gone engine_id,
   * at once), XFA_ERR_HANDSHAKE_FAILED, XFA_ERR_ENGINE_ID_MISMATCH or XFA_ERR_INVALID_ARG.
   */
  async acquire(engineId: string, address: string): Promise<PeerLease> {
    if (typeof engineId !== 'string' || !engineId) throw xfaError('XFA_ERR_INVALID_ARG', 'engineId must be a non-empty string')
    if (typeof address !== 'string' || !address) throw xfaError('XFA_ERR_INVALID_ARG', 'address must be a non-empty string', { engineId })
    for (;;) {
      if (this.isGone(engineId)) throw xfaError('XFA_ERR_PEER_GONE', `${engineId} was released`, { engineId, address })
      const gen = this.#peers.get(engineId) ?? this.#start(engineId, address)
      await gen.ready.promise
      // Dropped between becoming ready and this continuation: gone stays gone; after a
      // disconnect the loop re-handshakes.
      if (!gen.dropped) return this.#lease(gen)
      if (gen.dropped.reason !== 'disconnect') throw gen.dropped.error
    }
  }

  /**
   * The router's `peer_gone`: new acquires for these engine_ids (and those at these
   * addresses) fail fast from now on, handshakes in flight are aborted and their waiters fail
   * with XFA_ERR_PEER_GONE, and each one's NIXL state is released once no READ and no
   * handshake step of it is in flight. Resolves when all of that is released. Idempotent; an
   * unknown engine_id or address calls nothing on the gate (the engine_id is still
   * remembered as gone, so a late prefill answer naming it fails fast).
   */
  peerGone(target: PeerGoneTarget): Promise<void> {
    const ids = new Set(target.engineIds ?? [])
    for (const address of target.addresses ?? []) {
      const at = this.#byAddress.get(address)
      if (at !== undefined) ids.add(at)
      for (const gen of this.#peers.values()) if (gen.address === address) ids.add(gen.engineId)
      for (const set of this.#releasing.values()) for (const gen of set) if (gen.address === address) ids.add(gen.engineId)
    }
    const waits: Promise<void>[] = []
    for (const id of ids) {
      if (typeof id !== 'string' || !id) continue
      this.#gone(id, 'peer_gone')
      for (const gen of this.#releasing.get(id) ?? []) waits.push(gen.released.promise)
    }
    return Promise.all(waits).then(() => undefined)
  }

  /**
   * A READ to `engineId` failed with a remote disconnect (or found its peer dropped by NIXL):
   * the cached handshake is dropped, so the next acquire re-handshakes, and the gate forgets
   * the old state once its READs are done. Returns whether a cached handshake was dropped
   * (false while one is in flight, or for an unknown or gone engine_id).
   */
  markDisconnected(engineId: string, reason: 'disconnect' | 'stale_clock' = 'disconnect'): boolean {
    const gen = this.#peers.get(engineId)
    if (!gen || gen.state !== 'ready') return false
    this.#drop(gen, reason, xfaError('XFA_ERR_PEER_DISCONNECTED', `${engineId} at ${gen.address} (${reason})`, { engineId, address: gen.address }))
    return true
  }

  /**
   * Samples the clock of cached peer `engineId` again (a pull found P's deadline already
   * past: its clock reading may no longer fit). The handshake stays cached and its READs go
   * on: when the same NIXL agent answers, only the clock reading is replaced, for later
   * acquires. When another one answers there (P's agent restarted under the same engine_id),
   * the handshake is dropped as `stale_clock`, so the next acquire loads the new one. One
   * sample per generation at a time; resolves whether the reading was replaced, never rejects.
   */
  resampleClock(engineId: string): Promise<boolean> {
    const gen = this.#peers.get(engineId)
    if (!gen || gen.state !== 'ready') return Promise.resolve(false)
    gen.resampling ??= this.#resample(gen).finally(() => {
      gen.resampling = undefined
    })
    return gen.resampling
  }

  async #resample(gen: Generation): Promise<boolean> {
    let answer: HandshakeResult
    try {
      answer = await this.#handshake(gen.address, gen.engineId, gen.abort.signal)
    } catch {
      return false
    }
    const current = gen.answer
    if (gen.dropped || !current) return false
    if (answer.engineId !== gen.engineId || !answer.metadata.equals(current.metadata)) {
      this.markDisconnected(gen.engineId, 'stale_clock')
      return false
    }
    gen.answer = { ...current, clock: answer.clock }
    return true
  }

  /**
   * The router saw these engine_ids answering again (`peer_alive`): their tombstones are
   * lifted, so the next acquire handshakes instead of failing fast. Nothing of them is cached
   * (a gone generation was dropped), so nothing else changes. Returns how many were lifted.
   */
  revive(engineIds: readonly string[]): number {
    let n = 0
    for (const id of engineIds) if (this.#tombstones.delete(id)) n++
    return n
  }

  /** Whether `engineId` was released and still fails fast (its tombstone has not expired). */
  isGone(engineId: string): boolean {
    const at = this.#tombstones.get(engineId)
    if (at === undefined) return false
    if (this.#clock.monotonic() - at < this.#tombstoneTtlMs) return true
    this.#tombstones.delete(engineId)
    return false
  }

  /** READs in flight to `engineId`, over its current and not yet released generations. */
  reads(engineId: string): number {
    // A dropped generation leaves #peers when it enters #releasing: no double count.
    let n = this.#peers.get(engineId)?.reads ?? 0
    for (const gen of this.#releasing.get(engineId) ?? []) n += gen.reads
    return n
  }

  /** Every generation the table tracks (for metrics): current ones, then releasing ones. */
  peers(): PeerSnapshot[] {
    const out: PeerSnapshot[] = []
    for (const gen of this.#peers.values()) out.push({ engineId: gen.engineId, address: gen.address, state: gen.state, reads: gen.reads })
    for (const set of this.#releasing.values()) {
      for (const gen of set) out.push({ engineId: gen.engineId, address: gen.address, state: 'releasing', reads: gen.reads })
    }
    return out
  }

  /** Gone engine_ids remembered now (expired ones are pruned lazily). */
  get tombstones(): number {
    this.#prune()
    return this.#tombstones.size
  }

  // ---------------------------------------------------------------------------------------

  #start(engineId: string, address: string): Generation {
    const gen: Generation = {
      engineId,
      address,
      ready: quietDeferred(),
      released: quietDeferred(),
      abort: new AbortController(),
      answer: undefined,
      state: 'handshaking',
      reads: 0,
      running: true,
      loaded: false,
      dropped: undefined,
      finalizing: false,
      resampling: undefined,
    }
    this.#peers.set(engineId, gen)
    void this.#run(gen).finally(() => {
      gen.running = false
      this.#settle(gen)
    })
    return gen
  }

  async #run(gen: Generation): Promise<void> {
    const { engineId, address } = gen
    let answer: HandshakeResult
    try {
      answer = await this.#handshake(address, engineId, gen.abort.signal)
    } catch (cause) {
      if (!gen.dropped) this.#fail(gen, xfaError('XFA_ERR_HANDSHAKE_FAILED', `${engineId} at ${address}`, { engineId, address, cause }))
      return
    }
    if (gen.dropped) return // the answer came after peer_gone: nothing is loaded
    if (answer.engineId !== engineId) {
      const detail = `expected ${engineId}, ${address} answered ${String(answer.engineId)}`
      this.#fail(gen, xfaError('XFA_ERR_ENGINE_ID_MISMATCH', detail, { engineId, address }))
      // Our own record put the expected engine at this address, and another one answers
      // there now: the expected one is dead, so late pulls naming it should fail fast.
      if (this.#byAddress.get(address) === engineId) this.#gone(engineId, 'engine_id_changed')
      return
    }
    // A new engine_id at a known address: the old one restarted away (DESIGN, Peer cleanup).
    const previous = this.#byAddress.get(address)
    this.#byAddress.set(address, engineId)
    if (previous !== undefined && previous !== engineId) this.#gone(previous, 'engine_id_changed')

    // A disconnected older generation of this engine_id must be forgotten before the new
    // metadata is loaded, or its forgetPeer would drop the new state.
    const older = [...(this.#releasing.get(engineId) ?? [])].map((g) => g.released.promise)
    if (older.length > 0) {
      await Promise.race([Promise.all(older), aborted(gen.abort.signal)])
      if (gen.dropped) return
    }
    try {
      await this.#gate.loadPeer(engineId, answer.metadata, { probe: answer.probe ?? false })
    } catch (cause) {
      if (!gen.dropped) this.#fail(gen, xfaError('XFA_ERR_HANDSHAKE_FAILED', `the gate refused ${engineId}'s metadata`, { engineId, address, cause }))
      return
    }
    gen.loaded = true
    if (gen.dropped) return // dropped while loading: released once this settles
    gen.answer = answer
    gen.state = 'ready'
    gen.ready.resolve()
  }

  /** A handshake that failed: nothing cached, the waiters get `error`, a later acquire retries. */
  #fail(gen: Generation, error: XfaError): void {
    if (this.#peers.get(gen.engineId) === gen) this.#peers.delete(gen.engineId)
    gen.ready.reject(error)
  }

  /** Releases an engine_id for good: tombstone, then drop its current generation. */
  #gone(engineId: string, reason: 'peer_gone' | 'engine_id_changed'): void {
    this.#tombstones.delete(engineId) // re-inserted: keeps insertion order = age order
    this.#tombstones.set(engineId, this.#clock.monotonic())
    this.#prune()
    for (const [address, id] of this.#byAddress) if (id === engineId) this.#byAddress.delete(address)
    const gen = this.#peers.get(engineId)
    if (gen) this.#drop(gen, reason, xfaError('XFA_ERR_PEER_GONE', `${engineId} (${reason})`, { engineId, address: gen.address }))
  }

  #drop(gen: Generation, reason: PeerReleaseReason, error: XfaError): void {
    if (gen.dropped) return
    gen.dropped = { reason, error }
    if (this.#peers.get(gen.engineId) === gen) this.#peers.delete(gen.engineId)
    let set = this.#releasing.get(gen.engineId)
    if (!set) {
      set = new Set()
      this.#releasing.set(gen.engineId, set)
    }
    set.add(gen)
    gen.ready.reject(error)
    gen.abort.abort(error)
    this.#settle(gen)
  }

  /** Releases a dropped generation once nothing of it is in flight; exactly once. */
  #settle(gen: Generation): void {
    if (!gen.dropped || gen.reads > 0 || gen.running || gen.finalizing) return
    gen.finalizing = true
    void this.#finalize(gen, gen.dropped.reason)
  }

  async #finalize(gen: Generation, reason: PeerReleaseReason): Promise<void> {
    let error: unknown
    let failed = false
    if (gen.loaded) {
      try {
        await this.#gate.forgetPeer(gen.engineId)
      } catch (err) {
        error = err
        failed = true
      }
    }
    const set = this.#releasing.get(gen.engineId)
    set?.delete(gen)
    if (set?.size === 0) this.#releasing.delete(gen.engineId)
    gen.released.resolve()
    const release: PeerRelease = { engineId: gen.engineId, address: gen.address, reason, loaded: gen.loaded, ...(failed ? { error } : {}) }
    try {
      this.#onRelease?.(release)
    } catch {
      // A failing logger must not wedge peer cleanup; the state above is already consistent.
    }
  }

  #lease(gen: Generation): PeerLease {
    const answer = gen.answer as HandshakeResult
    gen.reads++
    let held = true
    return {
      engineId: gen.engineId,
      address: gen.address,
      metadata: answer.metadata,
      clock: answer.clock,
      probe: answer.probe ?? false,
      region: answer.region,
      signal: gen.abort.signal,
      release: () => {
        if (!held) return
        held = false
        gen.reads--
        this.#settle(gen)
      },
      markDisconnected: (reason: 'disconnect' | 'stale_clock' = 'disconnect') => {
        // Only this lease's generation: a stale failure must not drop a fresh handshake.
        if (this.#peers.get(gen.engineId) !== gen) return false
        return this.markDisconnected(gen.engineId, reason)
      },
    }
  }

  #prune(): void {
    const now = this.#clock.monotonic()
    for (const [id, at] of this.#tombstones) {
      if (this.#tombstones.size <= this.#maxTombstones && now - at < this.#tombstoneTtlMs) break
      this.#tombstones.delete(id)
    }
  }
}

function aborted(signal: AbortSignal): Promise<void> {
  if (signal.aborted) return Promise.resolve()
  return new Promise((resolve) => signal.addEventListener('abort', () => resolve(), { once: true }))
}
