/**
 * The sequence frame of vLLM's KV event messages (vllm/distributed/kv_events.py): 8 bytes,
 * big-endian, packed signed so the replay's end marker can be −1. Written by the simulator's
 * publisher, sent by the router's feed in its replay requests.
 */
export const END_SEQUENCE = -1n

export function sequenceFrame(seq: bigint): Buffer {
  const b = Buffer.alloc(8)
  b.writeBigInt64BE(seq)
  return b
}
