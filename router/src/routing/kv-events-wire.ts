import { decode } from '@msgpack/msgpack'

/*
 * vLLM's KV events as the router reads them (issue 39 part 2). One PUB message per engine step:
 * three frames, the topic, the sequence number (8 bytes big-endian) and msgpack of the
 * EventBatch `[ts, events, data_parallel_rank]` (vllm/distributed/kv_events.py, 0.32; the
 * simulator's sim/src/kv-events.ts writes the same). Events are maps tagged by `type` in 0.32;
 * releases before it wrote them positionally, `[tag, field, field, …]` in declaration order.
 * Both are read here, into one shape, so the index never sees the wire.
 *
 * Block hashes are unsigned 64-bit ints by default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES) and
 * bytes otherwise; either is only compared with what the same engine sent, so each becomes a
 * string key. The router never computes an engine's hash: it keys its index by its own chained
 * hash of the token ids (common/block-hash.ts).
 */

/** An engine's block hash, as a key (decimal for an int, hex for bytes). */
export type EngineHash = string

export type KvEvent =
  | {
      type: 'BlockStored'
      blockHashes: EngineHash[]
      parentBlockHash: EngineHash | null
      tokenIds: number[]
      blockSize: number
      medium: string | null
      groupIdx: number
      /**
       * Whether the engine's hashes cover the token ids alone. A LoRA adapter, a cache_salt or
       * multimodal inputs (vLLM 0.32's `lora_name`, `extra_keys`) make the same tokens another
       * block, which a hash of the tokens cannot tell apart.
       */
      tokensOnly: boolean
    }
  | { type: 'BlockRemoved'; blockHashes: EngineHash[]; medium: string | null; groupIdx: number }
  | { type: 'AllBlocksCleared' }

export interface KvEventBatch {
  /** Seconds since the epoch, the engine's clock. */
  ts: number
  events: KvEvent[]
  dataParallelRank: number | null
}

/** A message that is not a KV event batch (the subscriber counts it and drops the message). */
export class KvEventsWireError extends Error {
  override name = 'KvEventsWireError'
}

/** The sequence frame: 8 bytes, big-endian (vLLM packs it signed; the replay's end marker is −1). */
export function readSequence(frame: Uint8Array): bigint {
  if (frame.byteLength !== 8) throw new KvEventsWireError(`sequence frame of ${frame.byteLength} bytes, not 8`)
  return new DataView(frame.buffer, frame.byteOffset, 8).getBigInt64(0, false)
}

/** Decodes one batch's payload frame. Unknown event types are skipped (a newer vLLM may add some). */
export function decodeKvBatch(payload: Uint8Array): KvEventBatch {
  let raw: unknown
  try {
    raw = decode(payload, { useBigInt64: true })
  } catch (err) {
    throw new KvEventsWireError(`payload is not msgpack: ${(err as Error).message}`)
  }
  if (!Array.isArray(raw) || raw.length < 2 || !Array.isArray(raw[1])) throw new KvEventsWireError('payload is not an EventBatch [ts, events, dp_rank]')
  const [ts, events, rank] = raw as [unknown, unknown[], unknown]
  const out: KvEvent[] = []
  for (const e of events) {
    const event = Array.isArray(e) ? positional(e) : e !== null && typeof e === 'object' ? tagged(e as Record<string, unknown>) : undefined
    if (event) out.push(event)
  }
  return { ts: toNumber(ts) ?? 0, events: out, dataParallelRank: rank === null || rank === undefined ? null : (toNumber(rank) ?? null) }
}

function tagged(e: Record<string, unknown>): KvEvent | undefined {
  switch (e.type) {
    case 'BlockStored':
      return stored(e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size, e.medium, e.group_idx, tokensOnly(e))
    case 'BlockRemoved':
      return { type: 'BlockRemoved', blockHashes: hashes(e.block_hashes), medium: medium(e.medium), groupIdx: toNumber(e.group_idx) ?? 0 }
    case 'AllBlocksCleared':
      return { type: 'AllBlocksCleared' }
    default:
      return undefined
  }
}

/**
 * The fields that say a block's hash covers more than its tokens: vLLM 0.32's `lora_name` and
 * per-block `extra_keys`, and the older `lora_id`.
 */
function tokensOnly(e: Record<string, unknown>): boolean {
  const extra = e.extra_keys
  return e.lora_id == null && e.lora_name == null && (extra == null || (Array.isArray(extra) && extra.every((k) => k == null)))
}

/**
 * The releases before 0.32's tagged maps (msgspec array_like): the tag, then block_hashes,
 * parent_block_hash, token_ids, block_size, lora_id, medium; BlockRemoved's block_hashes, medium.
 * They had no KV cache groups and no other hash keys than lora_id.
 */
function positional(e: unknown[]): KvEvent | undefined {
  switch (e[0]) {
    case 'BlockStored':
      return stored(e[1], e[2], e[3], e[4], e[6], 0, e[5] == null)
    case 'BlockRemoved':
      return { type: 'BlockRemoved', blockHashes: hashes(e[1]), medium: medium(e[2]), groupIdx: 0 }
    case 'AllBlocksCleared':
      return { type: 'AllBlocksCleared' }
    default:
      return undefined
  }
}

function stored(blockHashes: unknown, parent: unknown, tokenIds: unknown, blockSize: unknown, m: unknown, groupIdx: unknown, onlyTokens: boolean): KvEvent {
  const size = toNumber(blockSize)
  if (size === undefined || !Number.isInteger(size) || size < 1) throw new KvEventsWireError(`BlockStored with block_size ${String(blockSize)}`)
  if (!Array.isArray(tokenIds)) throw new KvEventsWireError('BlockStored without token_ids')
  const tokens = tokenIds.map((t) => {
    const n = toNumber(t)
    if (n === undefined) throw new KvEventsWireError('BlockStored with a token id that is not a number')
    return n
  })
  return {
    type: 'BlockStored',
    blockHashes: hashes(blockHashes),
    parentBlockHash: parent === null || parent === undefined ? null : hashKey(parent),
    tokenIds: tokens,
    blockSize: size,
    medium: medium(m),
    groupIdx: toNumber(groupIdx) ?? 0,
    tokensOnly: onlyTokens,
  }
}

function hashes(v: unknown): EngineHash[] {
  if (!Array.isArray(v)) throw new KvEventsWireError('block_hashes is not a list')
  return v.map(hashKey)
}

function hashKey(v: unknown): EngineHash {
  // msgpack gives a bigint for a 64-bit int and a number for a smaller one: the same key either way.
  if (typeof v === 'bigint') return BigInt.asUintN(64, v).toString()
  if (typeof v === 'number' && Number.isInteger(v)) return BigInt.asUintN(64, BigInt(v)).toString()
  if (v instanceof Uint8Array) return `x${Buffer.from(v.buffer, v.byteOffset, v.byteLength).toString('hex')}`
  throw new KvEventsWireError(`a block hash that is neither an int nor bytes (${typeof v})`)
}

const medium = (v: unknown): string | null => (typeof v === 'string' ? v : null)

function toNumber(v: unknown): number | undefined {
  if (typeof v === 'number') return v
  if (typeof v === 'bigint') return Number(v)
  return undefined
}
