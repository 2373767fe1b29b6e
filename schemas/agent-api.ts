import Type, { type Static } from 'typebox'

/*
 * The transfer agent's wire messages (docs/transfer-agent.md "API"). Two audiences:
 * - its own engine, over loopback: attach the KV region, lease blocks (as prefiller), pull a
 *   remote request's blocks (as decoder), and read the agent's events (leases ended, tainted
 *   blocks quiescent);
 * - other agents: the handshake (NIXL metadata, engine_id, clock reading, KV region layout).
 * Every body is validated against these schemas; a bad one is a coded 400.
 */

const Id = Type.String({ minLength: 1, maxLength: 256 })
const BlockId = Type.Integer({ minimum: 0 })
// 1,048,576 blocks of 16 tokens is a 16 M-token context: far above any model's.
const BlockIds = Type.Array(BlockId, { minItems: 1, maxItems: 1_048_576 })

/** POST /v1/engine/attach: the engine names itself and its KV region (a shared-memory file). */
export const AgentAttach = Type.Object(
  {
    engineId: Id,
    role: Type.Union([Type.Literal('prefill'), Type.Literal('decode'), Type.Literal('both')]),
    // POSIX shared-memory object name ("/handoff-kv-…") holding numBlocks × blockBytes bytes.
    shmName: Type.String({ minLength: 2, maxLength: 250, pattern: '^/[^/]+$' }),
    blockSize: Type.Integer({ minimum: 1, maximum: 1024 }),
    bytesPerToken: Type.Integer({ minimum: 8, maximum: 65536 }),
    numBlocks: Type.Integer({ minimum: 1, maximum: 16_777_216 }),
    engineUrl: Type.Optional(Type.String({ maxLength: 2048 })),
  },
  { $id: 'AgentAttach', additionalProperties: false },
)
export type AgentAttach = Static<typeof AgentAttach>

export const AgentAttached = Type.Object(
  {
    // One per agent process: an engine that sees another one knows its agent restarted.
    agentId: Type.String(),
    engineId: Type.String(),
    // Where peers handshake (advertise as remote_host/remote_port).
    peerHost: Type.String(),
    peerPort: Type.Integer(),
    leaseSeconds: Type.Number(),
  },
  { $id: 'AgentAttached', additionalProperties: false },
)
export type AgentAttached = Static<typeof AgentAttached>

/** POST /v1/leases (prefiller): hold these blocks for request `requestId` until read or expired. */
export const LeaseRequest = Type.Object(
  {
    requestId: Id,
    blockIds: BlockIds,
    // Read-done notifications to wait for (vLLM: one per D rank reading this P rank).
    consumers: Type.Optional(Type.Integer({ minimum: 1, maximum: 1024 })),
  },
  { $id: 'LeaseRequest', additionalProperties: false },
)
export type LeaseRequest = Static<typeof LeaseRequest>

export const LeaseGranted = Type.Object(
  {
    requestId: Type.String(),
    // The deadline on this agent's clock, seconds: export as remote_blocks_expiry_time.
    expiresAt: Type.Number(),
    leaseSeconds: Type.Number(),
  },
  { $id: 'LeaseGranted', additionalProperties: false },
)
export type LeaseGranted = Static<typeof LeaseGranted>

/**
 * remote_host as P advertised it: a DNS name (labels of 1–63 letters, digits and inner
 * hyphens), an IPv4 address or an IPv6 literal without brackets. Nothing that could carry a
 * path, a query, credentials or a port into the URL the agent dials.
 */
const PeerHost = Type.String({
  minLength: 1,
  maxLength: 253,
  pattern: '^(?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?(?:\\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*|[0-9A-Fa-f.]*:[0-9A-Fa-f:.]*)$',
})

/** POST /v1/pulls (decoder): READ a prefiller's blocks into local blocks. */
export const PullRequest = Type.Object(
  {
    // The decoder's own request id: one pull at a time per id.
    requestId: Id,
    remoteEngineId: Id,
    remoteRequestId: Id,
    remoteHost: PeerHost,
    remotePort: Type.Integer({ minimum: 1, maximum: 65535 }),
    remoteBlockIds: BlockIds,
    // P's lease deadline on P's clock (seconds); null: P exported none, nothing to check.
    remoteBlocksExpiryTime: Type.Union([Type.Number(), Type.Null()]),
    localBlockIds: BlockIds,
  },
  { $id: 'PullRequest', additionalProperties: false },
)
export type PullRequest = Static<typeof PullRequest>

/**
 * POST /v1/pulls/expected: the engine learned of a request it will pull (vLLM's scheduler
 * heartbeats such a request from then on), and says so again every heartbeat interval while
 * it waits. The agent heartbeats P for it until the pull takes over or the expectation lapses.
 */
export const PullExpected = Type.Object(
  {
    remoteEngineId: Id,
    remoteRequestId: Id,
    remoteHost: PeerHost,
    remotePort: Type.Integer({ minimum: 1, maximum: 65535 }),
  },
  { $id: 'PullExpected', additionalProperties: false },
)
export type PullExpected = Static<typeof PullExpected>

export const PullExpectation = Type.Object(
  {
    // How long the agent keeps heartbeating without hearing again: say it again sooner.
    ttlMs: Type.Number(),
  },
  { $id: 'PullExpectation', additionalProperties: false },
)
export type PullExpectation = Static<typeof PullExpectation>

export const PullDone = Type.Object(
  {
    requestId: Type.String(),
    bytes: Type.Integer(),
    // NIXL's time for the READ, and the agent's whole time for the pull (handshake included).
    readMicros: Type.Number(),
    pullMicros: Type.Number(),
  },
  { $id: 'PullDone', additionalProperties: false },
)
export type PullDone = Static<typeof PullDone>

/**
 * A failed pull: the usual error body plus which local blocks hold no valid KV and whether
 * they are tainted (a READ may still write into them: the engine must not reuse them until a
 * `pull_quiesced` event names this request).
 */
export const PullFailed = Type.Object(
  {
    error: Type.Object({ code: Type.String(), message: Type.String() }, { additionalProperties: true }),
    invalidBlockIds: Type.Array(BlockId),
    tainted: Type.Boolean(),
  },
  { $id: 'PullFailed', additionalProperties: false },
)
export type PullFailed = Static<typeof PullFailed>

/** One entry of GET /v1/engine/events. */
export const AgentEvent = Type.Union(
  [
    Type.Object(
      {
        seq: Type.Integer(),
        type: Type.Literal('lease_ended'),
        requestId: Type.String(),
        blockIds: Type.Array(BlockId),
        reason: Type.Union([Type.Literal('read_done'), Type.Literal('released'), Type.Literal('expired')]),
      },
      { additionalProperties: false },
    ),
    Type.Object(
      { seq: Type.Integer(), type: Type.Literal('pull_quiesced'), requestId: Type.String(), blockIds: Type.Array(BlockId) },
      { additionalProperties: false },
    ),
  ],
  { $id: 'AgentEvent' },
)
export type AgentEvent = Static<typeof AgentEvent>

export const AgentEvents = Type.Object(
  {
    agentId: Type.String(),
    events: Type.Array(Type.Ref('AgentEvent')),
    // Pass as `after` next time; everything up to it counts as received and is dropped.
    last: Type.Integer(),
  },
  { $id: 'AgentEvents', additionalProperties: false },
)
export type AgentEvents = { agentId: string; events: AgentEvent[]; last: number }

/** GET /v1/peer/handshake: what a decoder's agent learns about a prefiller's agent. */
export const PeerHandshake = Type.Object(
  {
    engineId: Type.String(),
    agentId: Type.String(),
    // NIXL metadata (nixl_capi_get_local_md), base64.
    metadata: Type.String(),
    // The agent's monotonic clock, seconds, read while answering (remote_blocks_expiry_time's clock).
    clock: Type.Number(),
    // It runs handoff's addon, so the disconnect probe is safe to send to it.
    probe: Type.Boolean(),
    region: Type.Object(
      {
        // Decimal string: a 64-bit address does not fit a JSON number.
        addr: Type.String({ pattern: '^[0-9]+$' }),
        len: Type.Integer({ minimum: 1 }),
        blockBytes: Type.Integer({ minimum: 1 }),
        numBlocks: Type.Integer({ minimum: 1 }),
      },
      { additionalProperties: false },
    ),
  },
  { $id: 'PeerHandshake', additionalProperties: false },
)
export type PeerHandshake = Static<typeof PeerHandshake>

/** POST /v1/peers/gone (the router's peer_gone, until its event stream lands). */
export const PeerGoneRequest = Type.Object(
  {
    engineIds: Type.Optional(Type.Array(Id, { maxItems: 1024 })),
    addresses: Type.Optional(Type.Array(Type.String({ minLength: 3, maxLength: 260 }), { maxItems: 1024 })),
    reason: Type.Optional(Type.String({ maxLength: 256 })),
  },
  { $id: 'PeerGoneRequest', additionalProperties: false },
)
export type PeerGoneRequest = Static<typeof PeerGoneRequest>
