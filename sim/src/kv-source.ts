import type { Logger } from 'pino'
import type { Clock } from '../../common/clock.js'
import type { BlockPool } from './block-pool.js'
import type { KvRegion } from './kv-region.js'
import type { SimMetrics } from './metrics.js'

/** The fields a decoder needs to read a prefiller's blocks (vLLM registers no read without them). */
export interface RemoteKv {
  remoteEngineId: string
  remoteRequestId: string
  remoteHost: string
  remotePort: number
  /** As P sent them: one list per KV-cache group, or a flat list (older vLLM). */
  remoteBlockIds: readonly (readonly number[])[] | readonly number[]
  /** The block ids of the simulator's one KV-cache group, whichever shape P sent. */
  blockIds: readonly number[]
  remoteBlocksExpiryTime: number | null
  tpSize: number | undefined
}

/** A decoder's pull: READ `remote`'s blocks into `localBlocks` (the first `numTokens` positions count). */
export interface KvPull {
  /** The decoder's own request id (one pull at a time per id). */
  requestId: string
  remote: RemoteKv
  localBlocks: readonly number[]
  numTokens: number
  /** The engine's request: aborted when its client leaves or the app closes. */
  signal: AbortSignal
}

/** What a KvTransport is built from (buildApp hands it the engine's pieces). */
export interface KvTransportDeps {
  engineId: string
  region: KvRegion
  pool: BlockPool
  metrics: SimMetrics
  clock: Clock
  log: Logger
}

/**
 * The seam for `--kv agent` (agent-link.ts fills it with the transfer agent; tests with
 * in-process doubles). **Block ownership:** blocks handed to `lease` or to a `pull` that
 * rejects belong to the transport from then on, and it returns them to the pool exactly
 * once: a lease's when it ends (read, released or expired), a failed pull's once no READ can
 * still write into them. The engine frees only the blocks of a pull that resolved.
 */
export interface KvTransport {
  /** KV can move (attached to the agent and reaching it); `/health` answers 503 until then. */
  readonly ready: boolean
  /** What a prefiller exports as remote_host/remote_port: where decoders' agents handshake. */
  readonly peer: { host: string; port: number } | undefined
  /** Leases held (a prefiller's blocks waiting to be read). */
  readonly leases: number
  /** Blocks of failed pulls still waiting until no READ can write into them. */
  readonly taintedBlocks: number
  /** Leases `blocks` for `requestId`; resolves with `remote_blocks_expiry_time` (seconds, the agent's clock). */
  lease(requestId: string, blocks: readonly number[]): Promise<number>
  /** Ends a lease early (its client left after all); best effort, never throws. */
  release(requestId: string): void
  /** Resolves once the bytes are in `localBlocks`; rejects with a coded error (see SIM_ERR_AGENT_CALL). */
  pull(job: KvPull): Promise<void>
  /** The engine will pull `remote` later (it waits): heartbeats start now. Best effort, never throws. */
  expect?(remote: RemoteKv): void
  /** Resolves once `ready` first holds (the process announces itself then); none: at once. */
  whenReady?(): Promise<void>
  close(): Promise<void>
}

export type KvTransportFactory = (deps: KvTransportDeps) => KvTransport

export interface ParseRemoteKvOptions {
  /**
   * vLLM before `remote_request_id` (PR #29665, late 2025): P and D used the same request id
   * (the same X-Request-Id, no random suffix), so a missing `remote_request_id` means "mine".
   */
  legacyRequestId?: string
}

/** `kv_transfer_params` → RemoteKv, or the name of the first missing field (vLLM's check, §1.4). */
export function parseRemoteKv(params: Record<string, unknown>, opts: ParseRemoteKvOptions = {}): RemoteKv | { missing: string } {
  const blocks = params.remote_block_ids
  if (!Array.isArray(blocks) || blocks.length === 0) return { missing: 'remote_block_ids' }
  const group: unknown = Array.isArray(blocks[0]) ? blocks[0] : blocks
  if (!Array.isArray(group) || !group.every((b) => Number.isInteger(b))) return { missing: 'remote_block_ids' }
  const requestId = params.remote_request_id ?? opts.legacyRequestId
  for (const [f, v] of [['remote_engine_id', params.remote_engine_id], ['remote_request_id', requestId], ['remote_host', params.remote_host]] as const) {
    if (typeof v !== 'string' || v === '') return { missing: f }
  }
  if (typeof params.remote_port !== 'number') return { missing: 'remote_port' }
  const expiry = params.remote_blocks_expiry_time
  return {
    remoteEngineId: params.remote_engine_id as string,
    remoteRequestId: requestId as string,
    remoteHost: params.remote_host as string,
    remotePort: params.remote_port,
    remoteBlockIds: blocks as number[][],
    blockIds: group as number[],
    remoteBlocksExpiryTime: typeof expiry === 'number' ? expiry : null,
    tpSize: typeof params.tp_size === 'number' ? params.tp_size : undefined,
  }
}
