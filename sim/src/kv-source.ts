import type { KvRegion } from './kv-region.js'

/** The fields a decoder needs to read a prefiller's blocks (vLLM registers no read without them). */
export interface RemoteKv {
  remoteEngineId: string
  remoteRequestId: string
  remoteHost: string
  remotePort: number
  /** One list per KV-cache group; the simulator has one group. */
  remoteBlockIds: readonly (readonly number[])[] | readonly number[]
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

/** `kv_transfer_params` → RemoteKv, or the name of the first missing field (vLLM's check, §1.4). */
export function parseRemoteKv(params: Record<string, unknown>): RemoteKv | { missing: string } {
  const blocks = params.remote_block_ids
  if (!Array.isArray(blocks) || blocks.length === 0) return { missing: 'remote_block_ids' }
  for (const f of ['remote_engine_id', 'remote_request_id', 'remote_host'] as const) {
    if (typeof params[f] !== 'string' || params[f] === '') return { missing: f }
  }
  if (typeof params.remote_port !== 'number') return { missing: 'remote_port' }
  const expiry = params.remote_blocks_expiry_time
  return {
    remoteEngineId: params.remote_engine_id as string,
    remoteRequestId: params.remote_request_id as string,
    remoteHost: params.remote_host as string,
    remotePort: params.remote_port,
    remoteBlockIds: blocks as number[][],
    remoteBlocksExpiryTime: typeof expiry === 'number' ? expiry : null,
    tpSize: typeof params.tp_size === 'number' ? params.tp_size : undefined,
  }
}
