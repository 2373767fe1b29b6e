// The native gate: one typed entry point to the addon (NIXL READs and shared memory).
// - binding.ts: the .node file's shape, loading it, loading NIXL
// - descriptors.ts: descriptors, registrations, metadata names
// - agent.ts: NixlAgent (memory, peers by engine_id, READs, notifications, close)
// - shm.ts: POSIX shared memory
export * from './errors.js'
export { locateNixl, type LocateOptions, type NixlLocation } from './nixl-locate.js'
export { addonPath, loadNixl, loadedNixlPath, type LoadNixlOptions, type NativeStats, type NixlInfo } from './binding.js'
export {
  Registration,
  addressOf,
  metadataAgentName,
  packDescriptors,
  type Descriptor,
  type DescriptorInput,
  type ExternalRegion,
  type MemoryKind,
  type MemoryRegion,
} from './descriptors.js'
export {
  NixlAgent,
  createAgent,
  isTainted,
  type AgentOptions,
  type BackendInfo,
  type DeregisterOptions,
  type DisconnectEvent,
  type LoadPeerOptions,
  type Notification,
  type PeerInfo,
  type PreparedBlocks,
  type ReadOptions,
  type ReadResult,
  type SyncMode,
  type TaintedError,
  type WaitOptions,
} from './agent.js'
export { mapSharedMemory, unlinkSharedMemory, type SharedMemory, type SharedMemoryOptions } from './shm.js'
