import type { KvRegion } from './kv-region.js'

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

/**
 * The seam for `--kv agent`: "pull R's blocks into these local blocks through my transfer
 * agent". An implementation resolves once `numTokens` positions are in `localBlocks` of
 * `region`, or rejects with a coded error (KV expired, peer gone, transfer failed) naming the
 * invalid blocks. `--kv none` has no source: the decoder computes the KV itself.
 */
export interface KvSource {
  pull(remote: RemoteKv, region: KvRegion, localBlocks: readonly number[], numTokens: number, signal: AbortSignal): Promise<void>
}

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
