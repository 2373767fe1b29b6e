import Type, { type Static } from 'typebox'

/**
 * `kv_transfer_params` as a vLLM prefiller returns it (NixlPullConnector; connector version 14
 * in vLLM 0.32, tested against it in test/vllm/, and v12 before it) and a decoder receives it. The router passes the object verbatim from P to D and never rebuilds
 * it field by field, so unknown keys are allowed and kept; the schema only checks the fields
 * handoff itself reads.
 */
export const KvTransferParams = Type.Object(
  {
    do_remote_decode: Type.Optional(Type.Boolean()),
    do_remote_prefill: Type.Optional(Type.Boolean()),
    remote_engine_id: Type.Optional(Type.Union([Type.String(), Type.Null()])),
    // One list per KV-cache group ([[1,2,3]]); older vLLM sent a flat list. Opaque to handoff.
    remote_block_ids: Type.Optional(
      Type.Union([Type.Array(Type.Integer()), Type.Array(Type.Array(Type.Integer())), Type.Null()]),
    ),
    remote_request_id: Type.Optional(Type.Union([Type.String(), Type.Null()])),
    remote_host: Type.Optional(Type.Union([Type.String(), Type.Null()])),
    remote_port: Type.Optional(Type.Union([Type.Integer({ minimum: 0, maximum: 65535 }), Type.Null()])),
    tp_size: Type.Optional(Type.Integer({ minimum: 1 })),
    dcp_size: Type.Optional(Type.Integer({ minimum: 1 })),
    pp_size: Type.Optional(Type.Integer({ minimum: 1 })),
    remote_num_tokens: Type.Optional(Type.Integer({ minimum: 0 })),
    // Producer-clock deadline (agent mode); null on stock vLLM prefill answers.
    remote_blocks_expiry_time: Type.Optional(Type.Union([Type.Number(), Type.Null()])),
    transfer_mode: Type.Optional(Type.String()),
    // Connector v14 (vLLM 0.32): how many of the prompt's tokens P found in its prefix cache.
    remote_prefill_cached_tokens: Type.Optional(Type.Integer({ minimum: 0 })),
  },
  { $id: 'KvTransferParams', additionalProperties: true },
)
export type KvTransferParams = Static<typeof KvTransferParams>

/** What the router sends P on the prefill leg (vLLM's toy proxy sends the same placeholders). */
export const PREFILL_REQUEST_PARAMS = Object.freeze({
  do_remote_decode: true,
  do_remote_prefill: false,
  remote_engine_id: null,
  remote_block_ids: null,
  remote_host: null,
  remote_port: null,
})

/**
 * The fields a decoder needs before it will register a remote read (protocol reference §1.4).
 * `remote_request_id` is not among them: vLLM releases before late 2025 (PR #29665) do not
 * send it, and requiring it would make every request on them re-prefill silently.
 */
export const REQUIRED_HANDOFF_FIELDS = ['remote_engine_id', 'remote_block_ids', 'remote_host', 'remote_port'] as const

/** True when P's answer carries everything D needs to read the blocks. */
export function isCompleteHandoff(params: unknown): params is KvTransferParams {
  if (typeof params !== 'object' || params === null) return false
  const p = params as Record<string, unknown>
  for (const f of REQUIRED_HANDOFF_FIELDS) if (p[f] === undefined || p[f] === null) return false
  const blocks = p.remote_block_ids
  return Array.isArray(blocks) && blocks.length > 0
}
