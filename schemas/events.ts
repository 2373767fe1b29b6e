import Type, { type Static } from 'typebox'

/*
 * Router → agents events (DESIGN "Events: router → agents") and the control messages around
 * them: agent registration, acknowledgements, the ops `POST /fault_tolerance/event`. One
 * ordered log; every event has a sequence number; an agent resumes after the last one it
 * applied, and a snapshot replaces what it missed once that fell out of retention.
 */

const Id = Type.String({ minLength: 1, maxLength: 256 })
// host:port; a bracketed IPv6 host is allowed.
const Address = Type.String({ minLength: 3, maxLength: 262, pattern: '^(\\[[0-9A-Fa-f:.]+\\]|[A-Za-z0-9.-]+):[0-9]{1,5}$' })

export const PeerGoneEvent = Type.Object(
  {
    seq: Type.Integer({ minimum: 1 }),
    type: Type.Literal('peer_gone'),
    engineIds: Type.Array(Id),
    // Addresses as the agents know their peers (remote_host:remote_port of an agent).
    addresses: Type.Array(Address),
    reason: Type.String(),
    at: Type.Number(),
  },
  { $id: 'PeerGoneEvent', additionalProperties: false },
)

/**
 * An engine_id declared gone is answering again under that id (a prefill answer names it:
 * the engine's own word): agents lift its tombstone, so its blocks are read again at once
 * instead of failing fast for the tombstone's life (issue 17 item 6).
 */
export const PeerAliveEvent = Type.Object(
  {
    seq: Type.Integer({ minimum: 1 }),
    type: Type.Literal('peer_alive'),
    engineIds: Type.Array(Id, { minItems: 1 }),
    reason: Type.String(),
    at: Type.Number(),
  },
  { $id: 'PeerAliveEvent', additionalProperties: false },
)

export const LeaseReleaseEvent = Type.Object(
  {
    seq: Type.Integer({ minimum: 1 }),
    type: Type.Literal('lease_release'),
    // The prefiller whose agent holds the blocks; other agents ignore the event.
    prefillEngineId: Id,
    // P-side request ids (remote_request_id).
    requestIds: Type.Array(Id, { minItems: 1 }),
    reason: Type.String(),
    at: Type.Number(),
  },
  { $id: 'LeaseReleaseEvent', additionalProperties: false },
)

/**
 * For an agent that resumes after a sequence the log no longer holds: every engine_id
 * still remembered as gone. Lease releases it missed need no replay: a lease that old has
 * expired on the prefiller anyway (retention is kept above the lease duration).
 */
export const SnapshotEvent = Type.Object(
  {
    seq: Type.Integer({ minimum: 0 }),
    type: Type.Literal('snapshot'),
    goneEngineIds: Type.Array(Id),
    at: Type.Number(),
  },
  { $id: 'SnapshotEvent', additionalProperties: false },
)

export const RouterEvent = Type.Union([Type.Ref('PeerGoneEvent'), Type.Ref('PeerAliveEvent'), Type.Ref('LeaseReleaseEvent'), Type.Ref('SnapshotEvent')], { $id: 'RouterEvent' })
export type PeerGoneEvent = Static<typeof PeerGoneEvent>
export type PeerAliveEvent = Static<typeof PeerAliveEvent>
export type LeaseReleaseEvent = Static<typeof LeaseReleaseEvent>
export type SnapshotEvent = Static<typeof SnapshotEvent>
export type RouterEvent = PeerGoneEvent | PeerAliveEvent | LeaseReleaseEvent | SnapshotEvent

/** POST /v1/agents: an agent announces itself (after its engine attached). */
export const AgentRegistration = Type.Object(
  {
    agentId: Id,
    engineId: Id,
    role: Type.Union([Type.Literal('prefill'), Type.Literal('decode'), Type.Literal('both')]),
    // The agent's own URL (where peers handshake: its host:port is the peer address).
    agentUrl: Type.String({ format: 'uri', pattern: '^https?://', maxLength: 2048 }),
    // Its engine's URL, as the router knows the instance (matched against the topology).
    engineUrl: Type.Optional(Type.String({ format: 'uri', pattern: '^https?://', maxLength: 2048 })),
    // What follows the stream (default transfer-agent): a transfer agent checks every READ
    // against the lease itself; handoff's vLLM connector (issue 20) acts on the events but
    // does not, so the router keeps checking that decoder's reads (leases.readCheck auto).
    kind: Type.Optional(Type.Union([Type.Literal('transfer-agent'), Type.Literal('vllm-connector')])),
  },
  { $id: 'AgentRegistration', additionalProperties: false },
)
export type AgentRegistration = Static<typeof AgentRegistration>

export const AgentAck = Type.Object({ seq: Type.Integer({ minimum: 0 }) }, { $id: 'AgentAck', additionalProperties: false })
export type AgentAck = Static<typeof AgentAck>

/** POST /fault_tolerance/event (ops tooling), as in DESIGN. */
export const FaultToleranceEvent = Type.Object(
  {
    event_type: Type.Literal('peer_gone'),
    nodes: Type.Object(
      {
        engine_ids: Type.Optional(Type.Array(Id, { maxItems: 1024 })),
        addresses: Type.Optional(Type.Array(Address, { maxItems: 1024 })),
      },
      { additionalProperties: false },
    ),
    reason: Type.Optional(Type.String({ maxLength: 512 })),
  },
  { $id: 'FaultToleranceEvent', additionalProperties: false },
)
export type FaultToleranceEvent = Static<typeof FaultToleranceEvent>
