// NixlAgent: one NIXL agent, its registrations, its peers (by engine_id) and its READs.
import { EventEmitter } from 'node:events'
import { call, native, type NativeAgentHandle, type NativeEventFn, type NativeStats, type ReadOutcome } from './binding.js'
import {
  KIND_CODE,
  Registration,
  addressOf,
  isExternal,
  metadataAgentName,
  packDescriptors,
  triples,
  type Descriptor,
  type DescriptorInput,
  type MemoryKind,
  type MemoryRegion,
} from './descriptors.js'
import { nativeError, type NativeError } from './errors.js'

export type SyncMode = 'none' | 'strict' | 'rw'
const SYNC_CODE: Record<SyncMode, number> = { none: 0, strict: 1, rw: 2 }

export interface AgentOptions {
  /** NIXL's own progress thread; it must be on for a target that is only read from. */
  progressThread?: boolean
  /** NIXL's locking; the addon already serializes calls, so NONE is enough (default). */
  syncMode?: SyncMode
  /**
   * Progress thread period in µs. NIXL's default, 0, spins on sched_yield and keeps a whole
   * core busy even when idle (measured: 100% of a core); 100 µs costs about 4% (with this
   * addon's own 1 ms idle poll) and is the default here.
   */
  progressDelayUs?: number
  /** Poll period of the addon's completion thread while reads are in flight (µs). */
  busyPollUs?: number
  /** Poll period while idle; bounds notification latency (µs). */
  idlePollUs?: number
  /**
   * How long an aborted READ (cancel, deadline, close) may stay in progress in NIXL before it
   * settles as NAT_ERR_XFER_TAINTED instead of its own code (ms, default 5000).
   */
  quiesceMs?: number
  /**
   * Notifications kept for {@link NixlAgent.waitForNotification} until matched (default
   * 1024); 0 keeps none, for callers that only listen to 'notification' events.
   */
  notificationBuffer?: number
}

export interface ReadOptions {
  /** Delivered to the peer once the READ completed (NIXL notification). */
  notif?: Buffer | string
  /** The addon's own deadline; NIXL has none. Default 30 s; Infinity for none. */
  timeoutMs?: number
  signal?: AbortSignal
  localKind?: MemoryKind
  remoteKind?: MemoryKind
}

export interface ReadResult {
  bytes: number
  /** From post to completion seen by the poll thread, in µs. */
  micros: number
}

export interface Notification {
  /** The sender's NIXL agent name. */
  peer: string
  /** The sender's engine_id, when this agent loaded it. */
  engineId?: string
  message: Buffer
}

export interface BackendInfo {
  plugin: string
  mems: string[]
  params: Record<string, string>
}

export interface PeerInfo {
  engineId: string
  /** The peer's NIXL agent name. */
  name: string
  /** Whether the peer advertised the disconnect probe (our own agents do). */
  probe: boolean
}

export interface LoadPeerOptions {
  /**
   * The peer advertised the disconnect probe in its handshake (it runs this addon). Only then
   * may an ambiguous backend error be confirmed with a probe notification; toward any other
   * peer it stays a failed READ (NAT_ERR_NIXL_BACKEND) and invalidation is left to the
   * control plane.
   */
  probe?: boolean
}

export interface DisconnectEvent {
  engineId: string
  name: string
  error: NativeError
}

export interface WaitOptions {
  timeoutMs?: number
  signal?: AbortSignal
}

export interface DeregisterOptions {
  /** Wait for READs into the memory to become quiescent instead of failing at once. */
  wait?: boolean
}

/** The rejection of a READ that was aborted but that NIXL has not confirmed done. */
export interface TaintedError extends NativeError {
  code: 'NAT_ERR_XFER_TAINTED'
  /** The destination ranges that may still be written. */
  ranges: Descriptor[]
  /** Resolves once no byte can land any more (NIXL reported done, or the agent closed). */
  quiesced: Promise<void>
}

export function isTainted(err: unknown): err is TaintedError {
  return (err as { code?: unknown } | null)?.code === 'NAT_ERR_XFER_TAINTED'
}

/** A descriptor list prepared once (prep_xfer_dlist) and then named by block index. */
export interface PreparedBlocks {
  readonly id: number
  /** null for a local list. */
  readonly engineId: string | null
  readonly registration: Registration | null
  readonly base: bigint
  readonly devId: number
  readonly kind: MemoryKind
  readonly blockBytes: number
  readonly count: number
}

interface PeerState {
  readonly engineId: string
  readonly name: string
  readonly probe: boolean
  readonly reads: Set<Promise<unknown>>
  readonly lists: Set<PreparedBlocks>
  releasing: boolean
}

interface Waiter {
  match: (n: Notification) => boolean
  resolve: (n: Notification) => void
  reject: (e: Error) => void
}

type Events = { notification: [Notification]; disconnect: [DisconnectEvent] }

// Shared memory stays pinned (unmap refuses) while registered. An agent dropped without
// close() is collected (its native side then destroys the NIXL agent), and this registry
// unpins what it had registered. It must outlive the agents it watches, hence module level;
// it holds no agent, only the set of pinned registrations.
const dropped = new FinalizationRegistry<Set<Registration>>((pinned) => {
  for (const reg of pinned) native().pinShared(reg.addr, reg.len, -1)
})

/**
 * One NIXL agent. Emits `'notification'` ({@link Notification}) for every message a peer
 * sent, and `'disconnect'` ({@link DisconnectEvent}) when a READ found its peer gone. Every
 * method that talks to NIXL returns a promise; none blocks the event loop. Call
 * {@link close} to release NIXL state (an agent dropped without it is collected too).
 */
export class NixlAgent extends EventEmitter<Events> {
  readonly name: string
  readonly #native: NativeAgentHandle
  // Registered JS memory stays referenced here until deregistered, so GC cannot free it
  // under NIXL.
  readonly #registrations = new Map<Registration, MemoryRegion>()
  readonly #leaving = new Set<Registration>()
  readonly #shmPinned = new Set<Registration>()
  readonly #peers = new Map<string, PeerState>()
  readonly #gone = new Set<string>()
  readonly #reads = new Map<number, Promise<unknown>>()
  readonly #tainted = new Map<number, () => void>()
  readonly #buffer: Notification[] = []
  readonly #bufferMax: number
  readonly #waiters = new Set<Waiter>()
  #notificationsDropped = 0
  #peerOps: Promise<unknown> = Promise.resolve()
  #nextReadId = 1
  #closing = false
  #closed: Promise<void> | null = null

  private constructor(name: string, handle: NativeAgentHandle, bufferMax: number) {
    super()
    this.name = name
    this.#native = handle
    this.#bufferMax = bufferMax
  }

  /** @internal use {@link createAgent} */
  static async create(name: string, opts: AgentOptions = {}): Promise<NixlAgent> {
    if (!name) throw nativeError('NAT_ERR_INVALID_ARG', 'agent name must not be empty')
    const slot: { ref?: WeakRef<NixlAgent> } = {}
    const handle = new (native().NativeAgent)(NixlAgent.#eventsTo(slot))
    const self = new NixlAgent(name, handle, opts.notificationBuffer ?? 1024)
    slot.ref = new WeakRef(self)
    dropped.register(self, self.#shmPinned, self)
    await call(() =>
      handle.create(
        name,
        opts.progressThread ?? true,
        SYNC_CODE[opts.syncMode ?? 'none'],
        opts.progressDelayUs ?? 100,
        opts.busyPollUs ?? 50,
        opts.idlePollUs ?? 1000,
        opts.quiesceMs ?? 5000,
      ),
    )
    return self
  }

  // The native callback. The thread-safe function keeps it alive (a GC root) for the agent's
  // whole life, so it must reach neither the agent nor its native handle strongly, or a
  // dropped agent is never collected (issue #7, item 3). It is built here, in a scope that
  // holds nothing else, because a closure keeps every variable of its scope that any sibling
  // closure captures (in create(), the handle).
  static #eventsTo(slot: { ref?: WeakRef<NixlAgent> }): NativeEventFn {
    return (kind, a, b) => {
      const self = slot.ref?.deref()
      if (!self) return
      if (kind === 'quiesced') self.#quiesced(a as number)
      else self.#deliver(a as string, b ?? Buffer.alloc(0))
    }
  }

  listPlugins(): Promise<string[]> {
    return call(() => this.#native.listPlugins())
  }

  /** Memory kinds and default init parameters of a plugin (NAT_ERR_PLUGIN_MISSING if absent). */
  pluginParams(plugin: string): Promise<{ mems: string[]; params: Record<string, string> }> {
    return call(() => this.#native.pluginParams(plugin))
  }

  /** Creates a backend (UCX by default) and reports the parameters in effect. */
  async createBackend(plugin = 'UCX', params: Record<string, string> = {}): Promise<BackendInfo> {
    const out = await call(() => this.#native.createBackend(plugin, params))
    return { plugin, ...out }
  }

  /** Counters: probes sent, notification failures, tainted reads, notifications dropped. */
  stats(): NativeStats & { notificationsDropped: number } {
    return { ...this.#native.stats(), notificationsDropped: this.#notificationsDropped }
  }

  // ---------------------------------------------------------------------------------------
  // Memory

  async registerMemory(region: MemoryRegion): Promise<Registration> {
    this.#open()
    const reg = isExternal(region)
      ? new Registration(region.addr, region.len, region.devId ?? 0, region.kind)
      : new Registration(addressOf(region), region.byteLength, 0, 'dram')
    if (reg.len <= 0) throw nativeError('NAT_ERR_INVALID_ARG', 'cannot register an empty region')
    await call(() => this.#native.registerMem(KIND_CODE[reg.kind], packDescriptors([reg])))
    this.#registrations.set(reg, region)
    if (reg.kind === 'dram' && native().pinShared(reg.addr, reg.len, 1)) this.#shmPinned.add(reg)
    return reg
  }

  /**
   * Deregisters memory. Refuses with NAT_ERR_MEMORY_IN_USE while a READ may still write into
   * it, or waits for those READs to become quiescent with `{ wait: true }`.
   */
  async deregisterMemory(reg: Registration, opts: DeregisterOptions = {}): Promise<void> {
    if (!this.#registrations.has(reg) || this.#leaving.has(reg)) {
      throw nativeError('NAT_ERR_INVALID_ARG', 'not registered with this agent')
    }
    if (reg.readers > 0 && !opts.wait) {
      throw nativeError('NAT_ERR_MEMORY_IN_USE', `${reg.readers} READ(s) may still write into this registration`)
    }
    this.#leaving.add(reg) // no new READ may target it from here on
    try {
      await reg.idle()
      await call(() => this.#native.deregisterMem(KIND_CODE[reg.kind], packDescriptors([reg])))
      this.#registrations.delete(reg)
      if (this.#shmPinned.delete(reg)) native().pinShared(reg.addr, reg.len, -1)
    } finally {
      this.#leaving.delete(reg)
    }
  }

  // ---------------------------------------------------------------------------------------
  // Peers

  /** This agent's metadata blob, to hand to peers over the application's own channel. */
  localMetadata(): Promise<Buffer> {
    return call(() => this.#native.localMetadata())
  }

  /**
   * Loads a peer's metadata under its engine_id. Another engine_id with the same NIXL agent
   * name (a restarted peer) is forgotten first, as by {@link forgetPeer}; loading the same
   * engine_id again replaces its metadata once its READs have settled.
   */
  loadPeer(engineId: string, md: Buffer, opts: LoadPeerOptions = {}): Promise<PeerInfo> {
    if (!engineId) return Promise.reject(nativeError('NAT_ERR_INVALID_ARG', 'engineId must not be empty'))
    return this.#serial(() => this.#load(engineId, md, opts.probe ?? false))
  }

  /** Loads a peer's metadata with its NIXL agent name as engine_id; resolves with the name. */
  async loadRemoteMetadata(md: Buffer, opts: LoadPeerOptions = {}): Promise<string> {
    const info = await this.#serial(() => this.#load(metadataAgentName(md), md, opts.probe ?? false))
    return info.name
  }

  /**
   * Forgets a peer: new READs to it fail at once with NAT_ERR_PEER_GONE, READs in flight are
   * waited for (they settle quiescent, or tainted), then NIXL's state for it is invalidated.
   * Idempotent; an unknown engine_id is a no-op.
   */
  forgetPeer(engineId: string): Promise<void> {
    // Marked now, not when the serialized release starts: a READ issued right after this
    // call must already fail.
    const st = this.#peers.get(engineId)
    if (!st) return Promise.resolve()
    this.#gone.add(engineId)
    st.releasing = true
    return this.#serial(async () => {
      if (this.#peers.get(engineId) === st) await this.#release(st)
    })
  }

  /** The peers loaded now. */
  peers(): PeerInfo[] {
    return [...this.#peers.values()].filter((p) => !p.releasing).map((p) => ({ engineId: p.engineId, name: p.name, probe: p.probe }))
  }

  /** Whether NIXL holds metadata for the peer (false when never loaded, forgotten or dropped). */
  async checkPeer(engineId: string): Promise<boolean> {
    const st = this.#peers.get(engineId)
    if (!st || st.releasing) return false
    return call(() => this.#native.checkPeer(st.name))
  }

  genNotif(engineId: string, message: Buffer | string): Promise<void> {
    let st: PeerState
    try {
      st = this.#peerFor(engineId)
    } catch (err) {
      return Promise.reject(err)
    }
    return call(() => this.#native.genNotif(st.name, Buffer.from(message)))
  }

  // ---------------------------------------------------------------------------------------
  // READs

  /**
   * READ `remote[i]` of peer `engineId` into `local[i]`, all in one NIXL request. Every local
   * descriptor must lie in memory registered with this agent (use `reg.slice()`); that
   * registration counts the READ until no byte can land. Settles when NIXL reports the
   * request done, or rejects with a coded error: NAT_ERR_REMOTE_DISCONNECT, NAT_ERR_PEER_GONE,
   * NAT_ERR_PEER_UNKNOWN, NAT_ERR_XFER_TIMEOUT, NAT_ERR_XFER_CANCELED, NAT_ERR_AGENT_CLOSED
   * (all quiescent), NAT_ERR_XFER_TAINTED ({@link TaintedError}) or a NAT_ERR_NIXL_* status.
   */
  read(engineId: string, local: DescriptorInput, remote: DescriptorInput, opts: ReadOptions = {}): Promise<ReadResult> {
    let lt: BigUint64Array
    let rt: BigUint64Array
    let regs: Registration[]
    try {
      lt = triples(local)
      rt = triples(remote)
      this.#open()
      this.#peerFor(engineId)
      regs = this.#registrationsFor(lt, opts.localKind ?? 'dram')
    } catch (err) {
      return Promise.reject(err)
    }
    const ranges = (): Descriptor[] => {
      const out: Descriptor[] = []
      for (let i = 0; i + 2 < lt.length; i += 3) out.push({ addr: lt[i] ?? 0n, len: Number(lt[i + 1]), devId: Number(lt[i + 2]) })
      return out
    }
    return this.#transfer(engineId, opts, regs, ranges, (id, name, notif, timeoutMs) =>
      this.#native.read(id, name, KIND_CODE[opts.localKind ?? 'dram'], lt, KIND_CODE[opts.remoteKind ?? 'dram'], rt, notif, timeoutMs),
    )
  }

  /** Prepares a registration as `count` local blocks of `blockBytes` (index i at offset i × blockBytes). */
  async prepareLocalBlocks(reg: Registration, blockBytes: number): Promise<PreparedBlocks> {
    this.#open()
    if (!this.#registrations.has(reg)) throw nativeError('NAT_ERR_INVALID_ARG', 'not registered with this agent')
    const count = this.#blockCount(reg.len, blockBytes)
    const id = await call(() => this.#native.prepList('', KIND_CODE[reg.kind], blockList(reg.addr, reg.devId, blockBytes, count)))
    return { id, engineId: null, registration: reg, base: reg.addr, devId: reg.devId, kind: reg.kind, blockBytes, count }
  }

  /** Prepares a peer's region (`region.len` bytes at `region.addr`) as blocks of `blockBytes`. */
  async prepareRemoteBlocks(engineId: string, region: Descriptor, blockBytes: number, kind: MemoryKind = 'dram'): Promise<PreparedBlocks> {
    this.#open()
    const st = this.#peerFor(engineId)
    const count = this.#blockCount(region.len, blockBytes)
    const devId = region.devId ?? 0
    const id = await call(() => this.#native.prepList(st.name, KIND_CODE[kind], blockList(region.addr, devId, blockBytes, count)))
    const list: PreparedBlocks = { id, engineId, registration: null, base: region.addr, devId, kind, blockBytes, count }
    st.lists.add(list)
    return list
  }

  /** Releases a prepared list (NAT_ERR_MEMORY_IN_USE while a READ uses it). */
  async releaseBlocks(list: PreparedBlocks): Promise<void> {
    await call(() => this.#native.releaseList(list.id))
    if (list.engineId !== null) this.#peers.get(list.engineId)?.lists.delete(list)
  }

  /**
   * READ remote blocks `remoteIdx[i]` into local blocks `localIdx[i]` of two prepared lists,
   * in one NIXL request (make_xfer_req). Same settlement rules as {@link read}.
   */
  readBlocks(
    engineId: string,
    local: PreparedBlocks,
    localIdx: readonly number[] | Int32Array,
    remote: PreparedBlocks,
    remoteIdx: readonly number[] | Int32Array,
    opts: Omit<ReadOptions, 'localKind' | 'remoteKind'> = {},
  ): Promise<ReadResult> {
    const li = Int32Array.from(localIdx)
    const ri = Int32Array.from(remoteIdx)
    const reg = local.registration
    const bad =
      local.engineId !== null || !reg
        ? 'local list is not a local prepared list'
        : remote.engineId !== engineId
          ? `remote list was prepared for ${String(remote.engineId)}, not ${engineId}`
          : local.blockBytes !== remote.blockBytes
            ? 'local and remote block sizes differ'
            : li.length === 0 || li.length !== ri.length
              ? 'index lists must be non-empty and of equal length'
              : !inRange(li, local.count) || !inRange(ri, remote.count)
                ? 'block index out of range'
                : !this.#registrations.has(reg) || this.#leaving.has(reg)
                  ? 'local registration is gone'
                  : null
    if (bad !== null || !reg) return Promise.reject(nativeError('NAT_ERR_INVALID_ARG', bad ?? 'bad lists'))
    const ranges = (): Descriptor[] =>
      [...li].map((i) => ({ addr: local.base + BigInt(i * local.blockBytes), len: local.blockBytes, devId: local.devId }))
    return this.#transfer(engineId, opts, [reg], ranges, (id, name, notif, timeoutMs) =>
      this.#native.readPrepared(id, name, local.id, li, remote.id, ri, notif, timeoutMs, li.length * local.blockBytes),
    )
  }

  // ---------------------------------------------------------------------------------------
  // Notifications

  /**
   * Resolves with the first notification matching `match`, including one that arrived
   * before the call (kept in a bounded buffer); a matched notification is consumed. Rejects
   * with NAT_ERR_XFER_TIMEOUT after `timeoutMs` (default 30 s) or NAT_ERR_XFER_CANCELED when
   * `signal` aborts.
   */
  waitForNotification(match: (n: Notification) => boolean, opts: number | WaitOptions = {}): Promise<Notification> {
    const { timeoutMs = 30_000, signal } = typeof opts === 'number' ? { timeoutMs: opts } : opts
    const i = this.#buffer.findIndex(match)
    if (i >= 0) return Promise.resolve(this.#buffer.splice(i, 1)[0] as Notification)
    if (signal?.aborted) return Promise.reject(nativeError('NAT_ERR_XFER_CANCELED', 'wait aborted', { cause: signal.reason }))
    if (this.#closing) return Promise.reject(nativeError('NAT_ERR_AGENT_CLOSED', 'agent closed'))
    return new Promise((resolve, reject) => {
      let timer: NodeJS.Timeout | undefined
      const cleanup = (): void => {
        clearTimeout(timer)
        signal?.removeEventListener('abort', onAbort)
        this.#waiters.delete(w)
      }
      const w: Waiter = {
        match,
        resolve: (n) => {
          cleanup()
          resolve(n)
        },
        reject: (e) => {
          cleanup()
          reject(e)
        },
      }
      const onAbort = (): void => w.reject(nativeError('NAT_ERR_XFER_CANCELED', 'wait aborted', { cause: signal?.reason }))
      // setTimeout treats anything past 2^31-1 ms as 1 ms; a longer wait needs no timer.
      if (timeoutMs <= 0x7fffffff) {
        timer = setTimeout(() => w.reject(nativeError('NAT_ERR_XFER_TIMEOUT', `no matching notification within ${timeoutMs} ms`)), timeoutMs)
      }
      signal?.addEventListener('abort', onAbort, { once: true })
      this.#waiters.add(w)
    })
  }

  // ---------------------------------------------------------------------------------------
  // Close

  /**
   * Cancels READs in flight and waits until each is quiescent (or tainted), deregisters what
   * is still registered, stops the poll thread and destroys the NIXL agent, which stops any
   * tainted READ for good. Idempotent.
   */
  close(): Promise<void> {
    this.#closed ??= (async () => {
      this.#closing = true
      for (const id of this.#reads.keys()) this.#native.cancel(id)
      await Promise.allSettled([...this.#reads.values()])
      for (const reg of [...this.#registrations.keys()]) {
        // A tainted READ may still write here: leave it to the agent's destruction below.
        if (reg.readers === 0) await this.deregisterMemory(reg).catch(() => undefined) // best effort: the agent goes anyway
      }
      await call(() => this.#native.close())
      // The NIXL agent and its UCX workers are gone: nothing can write any more.
      for (const done of [...this.#tainted.values()]) done()
      this.#tainted.clear()
      for (const reg of this.#shmPinned) native().pinShared(reg.addr, reg.len, -1)
      this.#shmPinned.clear()
      this.#registrations.clear()
      for (const w of [...this.#waiters]) w.reject(nativeError('NAT_ERR_AGENT_CLOSED', 'agent closed while waiting for a notification'))
      dropped.unregister(this)
    })()
    return this.#closed
  }

  // ---------------------------------------------------------------------------------------
  // Internals

  #open(): void {
    if (this.#closing) throw nativeError('NAT_ERR_AGENT_CLOSED', 'the NIXL agent is closed')
  }

  #serial<T>(fn: () => Promise<T>): Promise<T> {
    const p = this.#peerOps.then(fn, fn)
    this.#peerOps = p.catch(() => undefined)
    return p
  }

  #peerFor(engineId: string): PeerState {
    const st = this.#peers.get(engineId)
    if (st && !st.releasing) return st
    if (st || this.#gone.has(engineId)) {
      throw nativeError('NAT_ERR_PEER_GONE', `${engineId} was forgotten; load its new metadata`, { peer: engineId })
    }
    throw nativeError('NAT_ERR_PEER_UNKNOWN', `no metadata loaded for ${engineId}`, { peer: engineId })
  }

  async #load(engineId: string | null, md: Buffer, probe: boolean): Promise<PeerInfo> {
    this.#open()
    const parsed = metadataAgentName(md)
    for (const st of [...this.#peers.values()]) {
      if (st.engineId === engineId) {
        await this.#release(st)
      } else if (parsed !== null && st.name === parsed) {
        // A restarted peer under a new engine_id: the old one is released the same way.
        this.#gone.add(st.engineId)
        await this.#release(st)
      }
    }
    const name = await call(() => this.#native.loadRemoteMetadata(md, probe))
    const id = engineId ?? name
    this.#gone.delete(id)
    this.#peers.set(id, { engineId: id, name, probe, reads: new Set(), lists: new Set(), releasing: false })
    return { engineId: id, name, probe }
  }

  // Fails new READs at once, waits for those in flight to settle (quiescent or tainted),
  // then drops NIXL's state for the peer.
  async #release(st: PeerState): Promise<void> {
    st.releasing = true
    await Promise.allSettled([...st.reads])
    for (const list of [...st.lists]) await this.releaseBlocks(list).catch(() => undefined)
    try {
      await call(() => this.#native.invalidatePeer(st.name))
    } catch (err) {
      // NIXL dropped it by itself (an older NIXL does after a disconnect): nothing to release.
      if ((err as NativeError).code !== 'NAT_ERR_PEER_UNKNOWN') throw err
    }
    this.#peers.delete(st.engineId)
  }

  #registrationsFor(t: BigUint64Array, kind: MemoryKind): Registration[] {
    const used = new Set<Registration>()
    let last: Registration | undefined
    for (let i = 0; i + 2 < t.length; i += 3) {
      const addr = t[i] ?? 0n
      const len = t[i + 1] ?? 0n
      const dev = t[i + 2] ?? 0n
      if (last?.contains(addr, len, dev)) continue
      last = undefined
      for (const reg of this.#registrations.keys()) {
        if (reg.kind === kind && !this.#leaving.has(reg) && reg.contains(addr, len, dev)) {
          last = reg
          break
        }
      }
      if (!last) {
        throw nativeError('NAT_ERR_INVALID_ARG', `local descriptor ${i / 3} is not inside ${kind} memory registered with this agent`)
      }
      used.add(last)
    }
    return [...used]
  }

  #blockCount(len: number, blockBytes: number): number {
    if (!Number.isSafeInteger(blockBytes) || blockBytes <= 0 || blockBytes > len) {
      throw nativeError('NAT_ERR_INVALID_ARG', `bad block size ${blockBytes} for ${len} bytes`)
    }
    return Math.floor(len / blockBytes)
  }

  #transfer(
    engineId: string,
    opts: Omit<ReadOptions, 'localKind' | 'remoteKind'>,
    regs: Registration[],
    ranges: () => Descriptor[],
    start: (id: number, name: string, notif: Buffer | null, timeoutMs: number) => Promise<ReadOutcome>,
  ): Promise<ReadResult> {
    const { signal } = opts
    let st: PeerState
    try {
      this.#open()
      st = this.#peerFor(engineId)
    } catch (err) {
      return Promise.reject(err)
    }
    if (signal?.aborted) return Promise.reject(nativeError('NAT_ERR_XFER_CANCELED', 'aborted before start', { cause: signal.reason }))
    const id = this.#nextReadId
    this.#nextReadId = id >= 0x7fffffff ? 1 : id + 1
    const notif = opts.notif === undefined ? null : Buffer.from(opts.notif)
    for (const reg of regs) reg.pin()
    const unpin = (): void => {
      for (const reg of regs) reg.unpin()
    }
    const onAbort = (): void => this.#native.cancel(id)
    signal?.addEventListener('abort', onAbort, { once: true })
    const p = call(() => start(id, st.name, notif, opts.timeoutMs ?? 30_000))
      .then(
        (res) => {
          unpin()
          return { bytes: res.bytes, micros: res.micros }
        },
        (err: NativeError) => {
          if (err.code === 'NAT_ERR_XFER_TAINTED') {
            // Still pinned: the registration counts this READ until it is quiescent.
            const quiesced = new Promise<void>((resolve) => {
              this.#tainted.set(id, () => {
                unpin()
                resolve()
              })
            })
            Object.assign(err, { ranges: ranges(), quiesced })
          } else {
            unpin()
          }
          if (err.code === 'NAT_ERR_REMOTE_DISCONNECT') this.emit('disconnect', { engineId: st.engineId, name: st.name, error: err })
          throw err
        },
      )
      .finally(() => {
        signal?.removeEventListener('abort', onAbort)
        st.reads.delete(p)
        this.#reads.delete(id)
      })
    st.reads.add(p)
    this.#reads.set(id, p)
    return p
  }

  #quiesced(id: number): void {
    const done = this.#tainted.get(id)
    this.#tainted.delete(id)
    done?.()
  }

  #deliver(peer: string, message: Buffer): void {
    let engineId: string | undefined
    for (const st of this.#peers.values()) if (st.name === peer) engineId = st.engineId
    const n: Notification = engineId === undefined ? { peer, message } : { peer, engineId, message }
    let consumed = false
    for (const w of this.#waiters) {
      if (w.match(n)) {
        w.resolve(n)
        consumed = true
        break
      }
    }
    // A buffer of 0: the caller consumes 'notification' events only (the transfer agent).
    if (!consumed && this.#bufferMax > 0) {
      this.#buffer.push(n)
      if (this.#buffer.length > this.#bufferMax) {
        this.#buffer.shift()
        this.#notificationsDropped++
      }
    }
    this.emit('notification', n)
  }
}

function blockList(base: bigint, devId: number, blockBytes: number, count: number): BigUint64Array {
  const out = new BigUint64Array(count * 3)
  const len = BigInt(blockBytes)
  const dev = BigInt(devId)
  for (let i = 0; i < count; i++) {
    out[i * 3] = base + BigInt(i) * len
    out[i * 3 + 1] = len
    out[i * 3 + 2] = dev
  }
  return out
}

function inRange(idx: Int32Array, count: number): boolean {
  for (const i of idx) if (i < 0 || i >= count) return false
  return true
}

/** Creates a NIXL agent (NIXL must be loaded first, see {@link loadNixl}). */
export function createAgent(name: string, opts: AgentOptions = {}): Promise<NixlAgent> {
  return NixlAgent.create(name, opts)
}
