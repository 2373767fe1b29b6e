import { EventEmitter } from 'node:events'
import { existsSync } from 'node:fs'
import { createRequire } from 'node:module'
import { isAbsolute, join, resolve } from 'node:path'
import { packageRoot } from '../common/paths.js'
import { fromNative, nativeError, type NativeError } from './errors.js'
import { locateNixl, type LocateOptions, type NixlLocation } from './nixl-locate.js'

export * from './errors.js'
export { locateNixl, type LocateOptions, type NixlLocation } from './nixl-locate.js'

// ---------------------------------------------------------------------------------------
// The shape of the compiled addon (native/src/addon.cc). Only this module touches it.

interface ReadOutcome {
  bytes: number
  micros: number
}

interface ParamsOutcome {
  mems: string[]
  params: Record<string, string>
}

interface NativeAgentHandle {
  create(name: string, progThread: boolean, syncMode: number, pthrDelayUs: number, busyPollUs: number, idlePollUs: number): Promise<void>
  listPlugins(): Promise<string[]>
  pluginParams(plugin: string): Promise<ParamsOutcome>
  createBackend(plugin: string, params: Record<string, string>): Promise<ParamsOutcome>
  registerMem(kind: number, triples: BigUint64Array): Promise<void>
  deregisterMem(kind: number, triples: BigUint64Array): Promise<void>
  localMetadata(): Promise<Buffer>
  loadRemoteMetadata(md: Buffer): Promise<string>
  invalidatePeer(peer: string): Promise<void>
  checkPeer(peer: string): Promise<boolean>
  genNotif(peer: string, msg: Buffer): Promise<void>
  read(id: number, peer: string, localKind: number, local: BigUint64Array, remoteKind: number, remote: BigUint64Array, notif: Buffer | null, timeoutMs: number): Promise<ReadOutcome>
  cancel(id: number): void
  close(): Promise<void>
}

interface NativeBinding {
  load(libDir: string): Promise<{ path: string; pluginDir: string }>
  loadedPath(): string | null
  NativeAgent: new (onNotification: (peer: string, msg: Buffer) => void) => NativeAgentHandle
  mapShared(name: string, size: number, create: boolean, exclusive: boolean): ArrayBuffer
  unmapShared(buffer: ArrayBuffer): boolean
  unlinkShared(name: string): boolean
  bufferAddress(buffer: ArrayBuffer | ArrayBufferView): bigint
}

/** Where node-gyp puts the addon; resolved from the package root so dist/ works too. */
export const addonPath = join(packageRoot, 'native', 'build', 'Release', 'handoff_native.node')

// The .node file is process-global once loaded (dlopen), so caching the handle here adds no
// state that tests could leak between each other.
let binding: NativeBinding | undefined

function native(): NativeBinding {
  if (binding) return binding
  if (!existsSync(addonPath)) {
    throw nativeError('NAT_ERR_ADDON_MISSING', `${addonPath} is missing; run \`npm run build:native\``)
  }
  const require = createRequire(import.meta.url)
  binding = require(addonPath) as NativeBinding
  return binding
}

async function call<T>(p: () => Promise<T>): Promise<T> {
  try {
    return await p()
  } catch (err) {
    throw fromNative(err)
  }
}

// ---------------------------------------------------------------------------------------
// Loading NIXL

export interface NixlInfo extends NixlLocation {
  /** The exact file dlopen()ed. */
  path: string
  pluginDir: string
}

export interface LoadNixlOptions extends LocateOptions {}

/**
 * Finds and loads NIXL's C API. Resolves with what was loaded; rejects with
 * NAT_ERR_NIXL_NOT_AVAILABLE when there is no usable library (the addon itself stays usable
 * for shared memory). Loading again with the same directory is a no-op.
 */
export async function loadNixl(opts: LoadNixlOptions = {}): Promise<NixlInfo> {
  const where = await locateNixl(opts)
  if (!where) {
    throw nativeError(
      'NAT_ERR_NIXL_NOT_AVAILABLE',
      'no NIXL_LIB_DIR, no installed nixl_cu12/nixl_cu13 package and no fetched wheel (run `npm run nixl:fetch`)',
    )
  }
  const libDir = isAbsolute(where.libDir) ? where.libDir : resolve(where.libDir)
  const loaded = await call(() => native().load(libDir))
  return { ...where, libDir, path: loaded.path, pluginDir: loaded.pluginDir }
}

/** The file NIXL was loaded from in this process, or null. */
export function loadedNixlPath(): string | null {
  return native().loadedPath()
}

// ---------------------------------------------------------------------------------------
// Memory and descriptors

export type MemoryKind = 'dram' | 'vram'

/** One contiguous range: a DRAM address, or a GPU address with its ordinal as devId. */
export interface Descriptor {
  addr: bigint
  len: number
  devId?: number
}

export interface ExternalRegion extends Descriptor {
  kind: MemoryKind
}

/** What can be registered: JS-owned memory (DRAM) or an address range the caller owns. */
export type MemoryRegion = ArrayBuffer | ArrayBufferView | ExternalRegion

export interface Registration {
  readonly addr: bigint
  readonly len: number
  readonly devId: number
  readonly kind: MemoryKind
}

const KIND_CODE: Record<MemoryKind, number> = { dram: 0, vram: 1 }

/** Address of JS memory (start of the view); valid while the memory is referenced. */
export function addressOf(buffer: ArrayBuffer | ArrayBufferView): bigint {
  return native().bufferAddress(buffer)
}

/** (addr, len, devId) triples, the addon's wire format; build once when reused. */
export function packDescriptors(descs: readonly Descriptor[]): BigUint64Array {
  const out = new BigUint64Array(descs.length * 3)
  descs.forEach((d, i) => {
    if (!Number.isSafeInteger(d.len) || d.len <= 0) throw nativeError('NAT_ERR_INVALID_ARG', `descriptor ${i} has bad length ${d.len}`)
    out[i * 3] = d.addr
    out[i * 3 + 1] = BigInt(d.len)
    out[i * 3 + 2] = BigInt(d.devId ?? 0)
  })
  return out
}

function isExternal(r: MemoryRegion): r is ExternalRegion {
  return !(r instanceof ArrayBuffer) && !ArrayBuffer.isView(r) && typeof (r as ExternalRegion).addr === 'bigint'
}

// ---------------------------------------------------------------------------------------
// Agent

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
}

export interface ReadOptions {
  /** Delivered to the peer once the READ completed (NIXL notification). */
  notif?: Buffer | string
  /** The addon's own deadline; NIXL has none. Default 30 s. */
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
  peer: string
  message: Buffer
}

export interface BackendInfo {
  plugin: string
  mems: string[]
  params: Record<string, string>
}

type DescriptorInput = readonly Descriptor[] | BigUint64Array

function triples(d: DescriptorInput): BigUint64Array {
  return d instanceof BigUint64Array ? d : packDescriptors(d)
}

/**
 * One NIXL agent. Emits `'notification'` ({@link Notification}) for every message a peer
 * sent (read-done notifications and genNotif). Every method returns a promise; none blocks
 * the event loop. Call {@link close} to release NIXL state.
 */
export class NixlAgent extends EventEmitter<{ notification: [Notification] }> {
  readonly name: string
  readonly #native: NativeAgentHandle
  // Registered JS memory stays referenced here until deregistered, so GC cannot free it
  // under NIXL.
  readonly #registrations = new Map<Registration, MemoryRegion>()
  #nextReadId = 1
  #closed: Promise<void> | null = null

  private constructor(name: string, handle: NativeAgentHandle) {
    super()
    this.name = name
    this.#native = handle
  }

  /** @internal use {@link createAgent} */
  static async create(name: string, opts: AgentOptions = {}): Promise<NixlAgent> {
    if (!name) throw nativeError('NAT_ERR_INVALID_ARG', 'agent name must not be empty')
    let self: NixlAgent | undefined
    const handle = new (native().NativeAgent)((peer, message) => {
      self?.emit('notification', { peer, message })
    })
    self = new NixlAgent(name, handle)
    await call(() =>
      handle.create(
        name,
        opts.progressThread ?? true,
        SYNC_CODE[opts.syncMode ?? 'none'],
        opts.progressDelayUs ?? 100,
        opts.busyPollUs ?? 50,
        opts.idlePollUs ?? 1000,
      ),
    )
    return self
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

  async registerMemory(region: MemoryRegion): Promise<Registration> {
    let reg: Registration
    if (isExternal(region)) {
      reg = { addr: region.addr, len: region.len, devId: region.devId ?? 0, kind: region.kind }
    } else {
      reg = { addr: addressOf(region), len: region.byteLength, devId: 0, kind: 'dram' }
    }
    if (reg.len <= 0) throw nativeError('NAT_ERR_INVALID_ARG', 'cannot register an empty region')
    await call(() => this.#native.registerMem(KIND_CODE[reg.kind], packDescriptors([reg])))
    this.#registrations.set(reg, region)
    return reg
  }

  async deregisterMemory(reg: Registration): Promise<void> {
    if (!this.#registrations.has(reg)) throw nativeError('NAT_ERR_INVALID_ARG', 'not registered with this agent')
    await call(() => this.#native.deregisterMem(KIND_CODE[reg.kind], packDescriptors([reg])))
    this.#registrations.delete(reg)
  }

  /** This agent's metadata blob, to hand to peers over the application's own channel. */
  localMetadata(): Promise<Buffer> {
    return call(() => this.#native.localMetadata())
  }

  /** Loads a peer's metadata; resolves with the peer's agent name. */
  loadRemoteMetadata(md: Buffer): Promise<string> {
    return call(() => this.#native.loadRemoteMetadata(md))
  }

  /** Drops a peer's metadata and disconnects (NAT_ERR_PEER_UNKNOWN if NIXL had none). */
  invalidatePeer(peer: string): Promise<void> {
    return call(() => this.#native.invalidatePeer(peer))
  }

  /** Whether NIXL holds metadata for the peer (false after a disconnect or invalidate). */
  checkPeer(peer: string): Promise<boolean> {
    return call(() => this.#native.checkPeer(peer))
  }

  genNotif(peer: string, message: Buffer | string): Promise<void> {
    return call(() => this.#native.genNotif(peer, Buffer.from(message)))
  }

  /**
   * READ `remote[i]` of `peer` into `local[i]`, all in one NIXL request. Settles when NIXL
   * reports completion, or rejects with a coded error: NAT_ERR_REMOTE_DISCONNECT (peer gone),
   * NAT_ERR_PEER_UNKNOWN (no metadata loaded), NAT_ERR_XFER_TIMEOUT, NAT_ERR_XFER_CANCELED,
   * NAT_ERR_AGENT_CLOSED or a NAT_ERR_NIXL_* status error.
   */
  read(peer: string, local: DescriptorInput, remote: DescriptorInput, opts: ReadOptions = {}): Promise<ReadResult> {
    const { signal } = opts
    if (signal?.aborted) return Promise.reject(nativeError('NAT_ERR_XFER_CANCELED', 'aborted before start', { cause: signal.reason }))
    const id = this.#nextReadId
    this.#nextReadId = id >= 0x7fffffff ? 1 : id + 1
    const notif = opts.notif === undefined ? null : Buffer.from(opts.notif)
    const onAbort = (): void => this.#native.cancel(id)
    signal?.addEventListener('abort', onAbort, { once: true })
    return call(() =>
      this.#native.read(
        id,
        peer,
        KIND_CODE[opts.localKind ?? 'dram'],
        triples(local),
        KIND_CODE[opts.remoteKind ?? 'dram'],
        triples(remote),
        notif,
        opts.timeoutMs ?? 30_000,
      ),
    ).finally(() => signal?.removeEventListener('abort', onAbort))
  }

  /** Resolves with the first notification matching `match`, or rejects after `timeoutMs`. */
  waitForNotification(match: (n: Notification) => boolean, timeoutMs: number): Promise<Notification> {
    return new Promise((resolveWait, rejectWait) => {
      const onNotif = (n: Notification): void => {
        if (!match(n)) return
        clearTimeout(timer)
        this.off('notification', onNotif)
        resolveWait(n)
      }
      const timer = setTimeout(() => {
        this.off('notification', onNotif)
        rejectWait(nativeError('NAT_ERR_XFER_TIMEOUT', `no matching notification within ${timeoutMs} ms`))
      }, timeoutMs)
      this.on('notification', onNotif)
    })
  }

  /**
   * Deregisters what is still registered, rejects reads in flight with NAT_ERR_AGENT_CLOSED,
   * stops the poll thread and destroys the NIXL agent. Idempotent.
   */
  close(): Promise<void> {
    this.#closed ??= (async () => {
      for (const reg of [...this.#registrations.keys()]) {
        await this.deregisterMemory(reg).catch(() => undefined) // best effort: the agent goes anyway
      }
      await call(() => this.#native.close())
      this.#registrations.clear()
    })()
    return this.#closed
  }
}

/** Creates a NIXL agent (NIXL must be loaded first, see {@link loadNixl}). */
export function createAgent(name: string, opts: AgentOptions = {}): Promise<NixlAgent> {
  return NixlAgent.create(name, opts)
}

// ---------------------------------------------------------------------------------------
// Shared memory

export interface SharedMemory {
  readonly name: string
  /** Backed by the shared pages; detached (length 0) after unmap(). */
  readonly buffer: ArrayBuffer
  readonly size: number
  readonly address: bigint
  /** Unmaps now instead of at garbage collection; deregister it from NIXL first. */
  unmap(): void
  /** Removes the name; mappings stay valid until unmapped. */
  unlink(): boolean
}

export interface SharedMemoryOptions {
  /** Create (and size) the region if it does not exist. */
  create?: boolean
  /** With create: fail if it already exists. */
  exclusive?: boolean
}

/**
 * Maps the POSIX shared-memory object `name` ("/something") into an ArrayBuffer. With
 * `create`, the object is created and sized to `size`; otherwise it must exist and be at
 * least `size` bytes (0 maps the whole object).
 */
export function mapSharedMemory(name: string, size: number, opts: SharedMemoryOptions = {}): SharedMemory {
  const n = native()
  let buffer: ArrayBuffer
  try {
    buffer = n.mapShared(name, size, opts.create ?? false, opts.exclusive ?? false)
  } catch (err) {
    throw fromNative(err)
  }
  const address = n.bufferAddress(buffer)
  return {
    name,
    buffer,
    size: buffer.byteLength,
    address,
    unmap: () => {
      n.unmapShared(buffer)
    },
    unlink: () => unlinkSharedMemory(name),
  }
}

export function unlinkSharedMemory(name: string): boolean {
  try {
    return native().unlinkShared(name)
  } catch (err) {
    throw fromNative(err)
  }
}

export type { NativeError }
