// The compiled addon (native/src/addon.cc): its typed shape, how it is loaded, and loading
// NIXL into it. Only the gate modules under native/ touch it.
import { existsSync } from 'node:fs'
import { createRequire } from 'node:module'
import { isAbsolute, join, resolve } from 'node:path'
import { packageRoot } from '../common/paths.js'
import { fromNative, nativeError } from './errors.js'
import { locateNixl, type LocateOptions, type NixlLocation } from './nixl-locate.js'

export interface ReadOutcome {
  bytes: number
  micros: number
}

export interface ParamsOutcome {
  mems: string[]
  params: Record<string, string>
}

export interface NativeStats {
  /** Disconnect probes sent (only ever to peers loaded with `probe: true`). */
  probesSent: number
  /** get_notifs / notification map failures (the map is cleared after each). */
  notifErrors: number
  /** Reads that settled as NAT_ERR_XFER_TAINTED. */
  tainted: number
}

/** Callback of the native agent: ('notification', peer, message) or ('quiesced', readId). */
export type NativeEventFn = (kind: 'notification' | 'quiesced', a: string | number, b?: Buffer) => void

export interface NativeAgentHandle {
  create(
    name: string,
    progThread: boolean,
    syncMode: number,
    pthrDelayUs: number,
    busyPollUs: number,
    idlePollUs: number,
    quiesceMs: number,
  ): Promise<void>
  listPlugins(): Promise<string[]>
  pluginParams(plugin: string): Promise<ParamsOutcome>
  createBackend(plugin: string, params: Record<string, string>): Promise<ParamsOutcome>
  registerMem(kind: number, triples: BigUint64Array): Promise<void>
  deregisterMem(kind: number, triples: BigUint64Array): Promise<void>
  localMetadata(): Promise<Buffer>
  loadRemoteMetadata(md: Buffer, probe: boolean): Promise<string>
  invalidatePeer(peer: string): Promise<void>
  checkPeer(peer: string): Promise<boolean>
  genNotif(peer: string, msg: Buffer): Promise<void>
  prepList(peer: string, kind: number, triples: BigUint64Array): Promise<number>
  releaseList(id: number): Promise<void>
  read(
    id: number,
    peer: string,
    localKind: number,
    local: BigUint64Array,
    remoteKind: number,
    remote: BigUint64Array,
    notif: Buffer | null,
    timeoutMs: number,
  ): Promise<ReadOutcome>
  readPrepared(
    id: number,
    peer: string,
    localList: number,
    localIdx: Int32Array,
    remoteList: number,
    remoteIdx: Int32Array,
    notif: Buffer | null,
    timeoutMs: number,
    bytes: number,
  ): Promise<ReadOutcome>
  cancel(id: number): void
  stats(): NativeStats
  close(): Promise<void>
}

export interface NativeBinding {
  load(libDir: string): Promise<{ path: string; pluginDir: string }>
  loadedPath(): string | null
  NativeAgent: new (onEvent: NativeEventFn) => NativeAgentHandle
  mapShared(name: string, size: number, create: boolean, exclusive: boolean, lock: boolean): ArrayBuffer
  unmapShared(buffer: ArrayBuffer): boolean
  unlinkShared(name: string): boolean
  pinShared(addr: bigint, len: number, delta: number): boolean
  bufferAddress(buffer: ArrayBuffer | ArrayBufferView): bigint
}

/** Where node-gyp puts the addon; resolved from the package root so dist/ works too. */
export const addonPath = join(packageRoot, 'native', 'build', 'Release', 'handoff_native.node')

// The .node file is process-global once loaded (dlopen), so caching the handle here adds no
// state that tests could leak between each other.
let binding: NativeBinding | undefined

export function native(): NativeBinding {
  if (binding) return binding
  if (!existsSync(addonPath)) {
    throw nativeError('NAT_ERR_ADDON_MISSING', `${addonPath} is missing; run \`npm run build:native\``)
  }
  const require = createRequire(import.meta.url)
  binding = require(addonPath) as NativeBinding
  return binding
}

/** Runs a native call and turns whatever it throws or rejects with into a coded error. */
export async function call<T>(p: () => Promise<T>): Promise<T> {
  try {
    return await p()
  } catch (err) {
    throw fromNative(err)
  }
}

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
