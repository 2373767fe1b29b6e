import Type, { type Static } from 'typebox'

/** The transfer agent's settings (`handoff agent` flags map onto these, kebab-case). */
export const AgentConfig = Type.Object(
  {
    // One address for the engine's loopback API and for peers' handshakes. Bind a routable
    // address only where peers are on other hosts; the engine API then needs the agent token.
    host: Type.String({ default: '127.0.0.1' }),
    port: Type.Integer({ minimum: 0, maximum: 65535, default: 0 }),
    // What peers are told to dial (remote_host); default: host.
    advertiseHost: Type.Optional(Type.String({ minLength: 1 })),
    // kv_lease_duration: must equal the prefiller's (protocol reference §2.4).
    leaseSeconds: Type.Number({ exclusiveMinimum: 0, default: 30 }),
    // The safety part of the deadline margin (DESIGN "Deadlines"), capped at lease / 4.
    safetyMs: Type.Number({ minimum: 0, default: 5000 }),
    // Heartbeat period; default lease / 6, as vLLM.
    heartbeatMs: Type.Optional(Type.Number({ exclusiveMinimum: 0 })),
    // A READ still in progress after this long is aborted (NIXL has no timeout of its own).
    readTimeoutMs: Type.Integer({ minimum: 1, default: 30000 }),
    handshakeTimeoutMs: Type.Integer({ minimum: 1, default: 5000 }),
    // The router(s) whose event log this agent follows (peer_gone, lease_release), comma
    // separated: tried in order, the next one when one cannot be reached. Unset: no router link.
    routerUrl: Type.Optional(Type.String({ minLength: 8, maxLength: 4096, pattern: '^https?://[^,\\s]+(,https?://[^,\\s]+)*$' })),
    // Needed on the engine API and by the router (its agent endpoints), when set.
    agentToken: Type.Optional(Type.String({ minLength: 1 })),
    // The agent↔agent credential: handshakes carry proofs made with it, never the secret
    // (transfer-agent/src/peer-proof.ts). Unset: the agent token is the key (one secret for
    // both planes); neither: peers are not authenticated.
    peerSecret: Type.Optional(Type.String({ minLength: 16 })),
    nixlLibDir: Type.Optional(Type.String({ minLength: 1 })),
    // The engine's KV region must be a shared-memory object named under this prefix; an attach
    // naming anything else is refused (XFA_ERR_ATTACH_REFUSED), so the engine plane cannot
    // make the agent map, and expose to peers, an object that is not a KV region.
    shmPrefix: Type.String({ minLength: 2, maxLength: 200, pattern: '^/[^/]+$', default: '/handoff-' }),
    // Accept pulls whose prefiller exported no lease expiry (remote_blocks_expiry_time null, as
    // vLLM's own P does): they are read with no lease check at all, so P may have reused the
    // blocks. Off: such a pull is refused (XFA_ERR_NO_LEASE_EXPIRY). Counted when on.
    allowNoExpiry: Type.Boolean({ default: false }),
    // TEST ONLY: skip both lease checks, to prove a scenario test can see stale reads.
    unsafeSkipDeadlineChecks: Type.Boolean({ default: false }),
    logLevel: Type.String({ default: 'info' }),
  },
  { $id: 'AgentConfig', additionalProperties: false },
)
export type AgentConfig = Static<typeof AgentConfig>
