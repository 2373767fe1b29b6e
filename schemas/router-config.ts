import Type, { type Static } from 'typebox'

/**
 * The router's config file (`handoff router --config FILE`, JSON). Defaults live here, so the
 * schema is the documentation; `router/src/config.ts` applies env overrides and validates.
 */
export const InstanceRole = Type.Union([Type.Literal('prefill'), Type.Literal('decode'), Type.Literal('both')], {
  $id: 'InstanceRole',
})
export type InstanceRole = Static<typeof InstanceRole>

/**
 * Where an engine publishes its KV cache events (vLLM's `--kv-events-config`): its ZMQ PUB
 * endpoint and replay endpoint as the router dials them (tcp://HOST:PORT), and the topic.
 * The router subscribes and indexes which prompt prefixes the engine holds (docs/routing.md).
 */
export const KvEventsSource = Type.Object(
  {
    endpoint: Type.String({ pattern: '^(tcp|ipc)://.+' }),
    replayEndpoint: Type.Optional(Type.String({ pattern: '^(tcp|ipc)://.+' })),
    topic: Type.Optional(Type.String()),
  },
  { additionalProperties: false },
)
export type KvEventsSource = Static<typeof KvEventsSource>

export const InstanceConfig = Type.Object(
  {
    id: Type.String({ minLength: 1, maxLength: 128, pattern: '^[A-Za-z0-9._:-]+$' }),
    role: Type.Ref('InstanceRole'),
    url: Type.String({ format: 'uri', pattern: '^https?://' }),
    // Free-form labels; `transfer_group` restricts pairing (see pairing.mode).
    labels: Type.Optional(Type.Record(Type.String(), Type.String())),
    kvEvents: Type.Optional(KvEventsSource),
  },
  { $id: 'InstanceConfig', additionalProperties: false },
)
export type InstanceConfig = Omit<Static<typeof InstanceConfig>, 'role'> & { role: InstanceRole }

/** Pods of one role: a label selector (Kubernetes syntax) and the engine's port in the pod. */
export const DiscoveryRole = Type.Object(
  {
    selector: Type.String({ minLength: 1 }),
    port: Type.Integer({ minimum: 1, maximum: 65535 }),
  },
  { additionalProperties: false },
)

/**
 * Engines found by the router itself (issue 11): pods that match a role's selector in
 * `namespace` become instances while they are Ready with an IP. Combines with `instances`.
 */
export const DiscoveryConfig = Type.Object(
  {
    kind: Type.Literal('kubernetes'),
    namespace: Type.String({ minLength: 1, maxLength: 63, pattern: '^[a-z0-9]([-a-z0-9]*[a-z0-9])?$' }),
    // A kubeconfig file; absent: the pod's service account (in-cluster), else $KUBECONFIG or ~/.kube/config.
    kubeconfig: Type.Optional(Type.String({ minLength: 1 })),
    prefill: Type.Optional(DiscoveryRole),
    decode: Type.Optional(DiscoveryRole),
    both: Type.Optional(DiscoveryRole),
    // After a watch fails (API server restart, network), the next try waits this long, doubling up to maxBackoffMs.
    backoffMs: Type.Integer({ minimum: 10, default: 500 }),
    maxBackoffMs: Type.Integer({ minimum: 10, default: 30000 }),
    // The API server ends each pod watch after a random time in [this, 2 × this); the watch then resumes from where it was.
    watchTimeoutSeconds: Type.Integer({ minimum: 1, maximum: 3600, default: 300 }),
    // A watch that carried nothing this long (the API server sends a bookmark about every minute), or a list that did not answer, is dead: dropped, counted, started again.
    idleTimeoutMs: Type.Integer({ minimum: 100, default: 150000 }),
    // Every this long (±10 %) the pods are listed again and diffed, so a change a watch missed is found; 0: never.
    relistIntervalMs: Type.Integer({ minimum: 0, default: 600000 }),
  },
  { additionalProperties: false },
)
export type DiscoveryConfig = Static<typeof DiscoveryConfig>

export const RouterConfig = Type.Object(
  {
    host: Type.String({ default: '127.0.0.1' }),
    port: Type.Integer({ minimum: 0, maximum: 65535, default: 8000 }),
    // The operations plane (/admin, /fault_tolerance, /topology, /leases) on a port of its own,
    // on `host`; set, those routes do not exist on `port` (a NetworkPolicy can then keep
    // clients off them). Unset: everything on `port`. Probes answer on every port.
    adminPort: Type.Optional(Type.Integer({ minimum: 0, maximum: 65535 })),
    // The agent plane (/v1/agents…) on a port of its own, likewise.
    agentPort: Type.Optional(Type.Integer({ minimum: 0, maximum: 65535 })),
    logLevel: Type.Union(
      [
        Type.Literal('fatal'),
        Type.Literal('error'),
        Type.Literal('warn'),
        Type.Literal('info'),
        Type.Literal('debug'),
        Type.Literal('trace'),
        Type.Literal('silent'),
      ],
      { default: 'info' },
    ),
    instances: Type.Array(Type.Ref('InstanceConfig'), { default: [] }),
    // The prefix index built from the engines' KV events (instances[].kvEvents): bounded.
    kvIndex: Type.Object(
      {
        // Blocks held per engine; past it the oldest stored go first (a GPU of 80 GiB holds
        // about 100,000 blocks of 16 tokens of an 8B model).
        maxBlocksPerEngine: Type.Integer({ minimum: 1, default: 262144 }),
        maxEngines: Type.Integer({ minimum: 1, default: 1024 }),
        // A replay that fills a gap in an engine's events must answer within this.
        replayTimeoutMs: Type.Integer({ minimum: 10, default: 5000 }),
      },
      { default: {}, additionalProperties: false },
    ),
    // Prefix-aware selection (docs/routing.md): where the prefix index holds any of a prompt,
    // the router asks an engine for the prompt's token ids and weighs each candidate's cached
    // share against its load. `load`: power of two choices on load alone, as before.
    routing: Type.Object(
      {
        policy: Type.Union([Type.Literal('prefix'), Type.Literal('load')], { default: 'prefix' }),
        // A candidate's cost, in prompts' worth of prefill: the share of the prompt it must
        // still compute (or, for D, pull) plus `loadWeight` for each request it has in flight.
        prefill: Type.Object({ loadWeight: Type.Number({ minimum: 0, default: 0.5 }) }, { default: {}, additionalProperties: false }),
        decode: Type.Object({ loadWeight: Type.Number({ minimum: 0, default: 1 }) }, { default: {}, additionalProperties: false }),
        // Never for its cache alone: a candidate with more in flight than `ratio` × the mean
        // of its side plus `slack` is not chosen for what it holds.
        loadGuard: Type.Object(
          { ratio: Type.Number({ minimum: 1, default: 1.5 }), slack: Type.Number({ minimum: 0, default: 2 }) },
          { default: {}, additionalProperties: false },
        ),
        // Decode-only: a decoder that holds all but `maxUncachedTokens` of the prompt (the next
        // turn of a conversation it decoded), or any decoder for a prompt of at most
        // `maxPromptTokens`, serves it alone: no P leg, no lease, no NIXL read. 0 turns either off.
        decodeOnly: Type.Object(
          { maxUncachedTokens: Type.Integer({ minimum: 0, default: 128 }), maxPromptTokens: Type.Integer({ minimum: 0, default: 0 }) },
          { default: {}, additionalProperties: false },
        ),
        // The engine's POST /tokenize: past this the request is routed on load alone.
        tokenize: Type.Object(
          {
            timeoutMs: Type.Integer({ minimum: 1, default: 500 }),
            // Token ids of recent prompts, by their text: a prompt sent again is not tokenized again.
            cacheEntries: Type.Integer({ minimum: 0, default: 4096 }),
          },
          { default: {}, additionalProperties: false },
        ),
      },
      { default: {}, additionalProperties: false },
    ),
    pairing: Type.Object(
      {
        // `all`: every decoder may read from every prefiller; `label`: only within the same
        // value of `label` (default `transfer_group`).
        mode: Type.Union([Type.Literal('all'), Type.Literal('label')], { default: 'all' }),
        label: Type.String({ default: 'transfer_group' }),
      },
      { default: {}, additionalProperties: false },
    ),
    timeouts: Type.Object(
      {
        connectMs: Type.Integer({ minimum: 1, default: 5000 }),
        // Waiting for P's whole answer (prefill of a long prompt).
        prefillMs: Type.Integer({ minimum: 1, default: 120000 }),
        // Waiting for D's response headers of a streamed answer (sent before generation starts).
        decodeHeadersMs: Type.Integer({ minimum: 1, default: 120000 }),
        // Waiting for a non-streamed answer, whose head vLLM sends only when generation ends:
        // the whole generation's bound, so generous (issue 19: a 120 s header deadline cut
        // long non-streamed generations).
        generationMs: Type.Integer({ minimum: 1, default: 3600000 }),
        // Longest silence between two body chunks of a streamed answer.
        idleMs: Type.Integer({ minimum: 1, default: 300000 }),
        // Idle upstream sockets are closed after this long. It must stay below the engine's own
        // keep-alive (uvicorn, and so vLLM, closes idle sockets after 5 s), or a request can be
        // written to a socket the engine is closing.
        upstreamKeepAliveMs: Type.Integer({ minimum: 1, default: 4000 }),
      },
      { default: {}, additionalProperties: false },
    ),
    limits: Type.Object(
      {
        bodyBytes: Type.Integer({ minimum: 1024, default: 16 * 1024 * 1024 }),
        // A backstop above admission's limits (admission.limit.max): the limits bound in-flight
        // requests per instance, and a connection pool below them would queue unseen.
        connectionsPerUpstream: Type.Integer({ minimum: 1, default: 4096 }),
        // Requests in flight on one instance at first; more wait in the admission queue. With
        // admission.limit.mode `adaptive` the limit then follows the engine; `fixed` keeps it.
        // vLLM's default max_num_seqs is 256 (1024 on GPUs of 70 GiB or more).
        maxInflightPerInstance: Type.Integer({ minimum: 1, default: 256 }),
        // Handoffs one request may fan out into: prompts of a batch × n choices, each a prefill
        // and a decode leg with its own lease. More is refused (400 RTR_ERR_TOO_MANY_HANDOFFS).
        maxHandoffsPerRequest: Type.Integer({ minimum: 1, default: 128 }),
        // Transfer agents the directory holds (POST /v1/agents). A new agent past it is refused
        // (503 RTR_ERR_TOO_MANY_AGENTS); one already known, or replacing the one at its
        // address, is always taken. With the Redis store every router counts all of them.
        maxAgents: Type.Integer({ minimum: 1, default: 1024 }),
      },
      { default: {}, additionalProperties: false },
    ),
    // When every eligible instance is at its cap, requests wait here (FIFO); a full queue or a
    // wait that runs out is answered 429 with Retry-After. Overload is not failure.
    admission: Type.Object(
      {
        queueLength: Type.Integer({ minimum: 0, default: 1024 }),
        queueTimeoutMs: Type.Integer({ minimum: 1, default: 30000 }),
        retryAfterSeconds: Type.Integer({ minimum: 1, default: 1 }),
        // How each instance's limit moves (router/src/admission/adaptive-limits.ts): `adaptive`
        // reads the engine's vllm:num_requests_running/waiting from its /metrics every
        // sampleIntervalMs while the instance holds half its limit or more, lowers the limit when
        // the engine queues more than engineQueue requests and raises it (10 %) when the engine
        // queues none and the limit binds. An engine without those metrics is judged by its
        // first-token times: recent ones over firstTokenTolerance x their long-run average lower it.
        limit: Type.Object(
          {
            mode: Type.Union([Type.Literal('adaptive'), Type.Literal('fixed')], { default: 'adaptive' }),
            min: Type.Integer({ minimum: 1, default: 4 }),
            max: Type.Integer({ minimum: 1, default: 4096 }),
            sampleIntervalMs: Type.Integer({ minimum: 50, default: 500 }),
            engineQueue: Type.Integer({ minimum: 0, default: 4 }),
            firstTokenTolerance: Type.Number({ exclusiveMinimum: 1, default: 2 }),
          },
          { default: {}, additionalProperties: false },
        ),
      },
      { default: {}, additionalProperties: false },
    ),
    health: Type.Object(
      {
        intervalMs: Type.Integer({ minimum: 50, default: 5000 }),
        timeoutMs: Type.Integer({ minimum: 10, default: 2000 }),
        // Consecutive failed probes that mark an instance down, and consecutive connect failures
        // of requests that eject it. Slow answers and engine error answers never count.
        unhealthyThreshold: Type.Integer({ minimum: 1, default: 3 }),
        // First ejection length; doubles on each re-ejection up to maxEjectionMs.
        baseEjectionMs: Type.Integer({ minimum: 1, default: 5000 }),
        maxEjectionMs: Type.Integer({ minimum: 1, default: 120000 }),
      },
      { default: {}, additionalProperties: false },
    ),
    // Data-plane API keys for /v1 routes; empty means open.
    apiKeys: Type.Array(Type.String({ minLength: 8 }), { default: [] }),
    // Guards /fault_tolerance/* and /admin/*; without it those endpoints answer 403.
    adminToken: Type.Optional(Type.String({ minLength: 8 })),
    // Drain-only credentials (engines' preStop hooks): POST /admin/instances/:id/drain and
    // nothing else of the operations plane. HANDOFF_DRAIN_TOKEN.
    drainTokens: Type.Array(Type.String({ minLength: 8 }), { default: [] }),
    // Agents present it on registration, event streams and acks; without it they are open.
    agentToken: Type.Optional(Type.String({ minLength: 8 })),
    // A circuit breaker per (prefiller, decoder) pair, fed by the decode leg's 5xx after a
    // prefill with params (a failed KV load): it opens after failureThreshold in a row, lets
    // one trial through after openMs, and rests twice as long after a failed trial.
    pairBreaker: Type.Object(
      {
        failureThreshold: Type.Integer({ minimum: 1, default: 3 }),
        openMs: Type.Integer({ minimum: 1, default: 10000 }),
        maxOpenMs: Type.Integer({ minimum: 1, default: 120000 }),
      },
      { default: {}, additionalProperties: false },
    ),
    // Engines without a transfer agent (stock vLLM moving KV itself): on every peer_gone the
    // router POSTs {"engine_id": …} to this template, `{instance_url}` and `{engine_id}`
    // replaced, e.g. "{instance_url}/drop_peer" (vLLM PR #56341). Unset: they are not told,
    // and each such notification is counted as not_configured.
    engineMode: Type.Object(
      {
        peerGoneUrl: Type.Optional(Type.String({ minLength: 1, pattern: '^\\{instance_url\\}' })),
        retries: Type.Integer({ minimum: 0, maximum: 10, default: 3 }),
        timeoutMs: Type.Integer({ minimum: 10, default: 2000 }),
        backoffMs: Type.Integer({ minimum: 1, default: 200 }),
      },
      { default: {}, additionalProperties: false },
    ),
    events: Type.Object(
      {
        // Events kept for agents that reconnect; an agent further behind gets a snapshot.
        retention: Type.Integer({ minimum: 1, default: 10000 }),
        // A comment line on idle agent streams, so proxies do not close them and agents can
        // tell a live router from a stalled one: they switch after about three silent intervals.
        keepAliveMs: Type.Integer({ minimum: 100, default: 5000 }),
        // Delivery bookkeeping: the agents each held event is for, summed over distinct lists
        // (events for the same agents share one). Past it the oldest events go, as past retention.
        deliveryEntries: Type.Integer({ minimum: 1, default: 1048576 }),
        // Unsent bytes an agent's event stream may hold; past it the stream reads on from the
        // log as the agent takes what it has. One that takes nothing for a keep-alive
        // interval with its buffer full is cut (the agent resumes by sequence).
        streamBufferBytes: Type.Integer({ minimum: 1024, default: 65536 }),
      },
      { default: {}, additionalProperties: false },
    ),
    // The lease ledger (DESIGN "One request, end to end" steps 4–5). leaseSeconds must equal
    // the engines' KV lease (vLLM's kv_lease_duration / VLLM_NIXL_ABORT_REQUEST_TIMEOUT, the
    // sim's --lease-seconds): a lease within marginMs of it is never sent to a decoder; it is
    // re-prefilled once (`reprefill`) or the request fails with RTR_ERR_LEASE_LAPSED (`fail`).
    leases: Type.Object(
      {
        leaseSeconds: Type.Number({ exclusiveMinimum: 0, default: 30 }),
        marginMs: Type.Integer({ minimum: 0, default: 1000 }),
        onLapsed: Type.Union([Type.Literal('reprefill'), Type.Literal('fail')], { default: 'reprefill' }),
        // Who checks D's read against the lease. `router`: D's answer is passed on only if
        // its first token came before the lease's expiry minus marginMs (stock vLLM in pull
        // mode reads P's blocks whenever it gets to them, even after P reaped and reused
        // them); the decode leg is then streamed from D so that token is seen (a non-streamed
        // answer is assembled by the router). `engine`: the decoder checks each read itself
        // (its handoff transfer agent does, before the READ and when it completes). `auto`:
        // `engine` for a decoder with a live transfer agent registered with agentToken (its
        // event stream open, or closed less than three events.keepAliveMs ago), `router` for
        // the others (and for all of them while agentToken is unset).
        readCheck: Type.Union([Type.Literal('auto'), Type.Literal('router'), Type.Literal('engine')], { default: 'auto' }),
        // With the router checking a decoder's reads, a non-streamed request's decode leg is
        // sent as it is (not streamed and assembled) when that decoder's recent pace says the
        // answer ends well within the read window: D's whole answer arriving before the read
        // deadline proves its read came before it too. One that does not arrive in time is
        // dropped and the prompt prefilled again with a streamed leg (needs onLapsed
        // `reprefill`). false: always streamed.
        proveByWholeAnswer: Type.Boolean({ default: true }),
        // Ended leases stay counted (GET /leases `entries`) this long. Nothing lists them, and
        // at 1,000 req/s a minute of them is 60,000 records the garbage collector keeps
        // marking, so by default they go at once; the cap bounds memory whatever the rate.
        retentionMs: Type.Integer({ minimum: 0, default: 0 }),
        maxEntries: Type.Integer({ minimum: 1, default: 100000 }),
      },
      { default: {}, additionalProperties: false },
    ),
    // Where shared state lives (docs/several-routers.md). `memory`: this process, one router.
    // `redis`: several routers on one Redis share the event log, topology, agent directory and
    // lease records; one of them probes (the prober leader, a lock with a TTL and a fencing token).
    store: Type.Object(
      {
        kind: Type.Union([Type.Literal('memory'), Type.Literal('redis')], { default: 'memory' }),
        // redis://[:password@]host:port[/db] or rediss://…, or through Sentinel
        // redis+sentinel://[:password@]host:port[,host:port…]/master[/db] (rediss+sentinel://
        // for TLS, ?sentinelPassword=… when the sentinels want one); required with kind redis.
        url: Type.Optional(Type.String({ pattern: '^rediss?(\\+sentinel)?://' })),
        // Every key this router writes starts with it: several fleets can share one Redis.
        prefix: Type.String({ minLength: 1, maxLength: 64, pattern: '^[A-Za-z0-9._:-]+$', default: 'handoff:' }),
        // A replica is alive while its membership entry is renewed (every third of this); the
        // prober leader's lock lives as long. A replica that stops renewing is gone after it.
        memberTtlMs: Type.Integer({ minimum: 300, maximum: 60000, default: 3000 }),
        // Redis commands that take longer fail, and the store counts as unreachable.
        commandTimeoutMs: Type.Integer({ minimum: 10, maximum: 60000, default: 1000 }),
      },
      { default: {}, additionalProperties: false },
    ),
    // Pods found through the Kubernetes API; absent: only `instances` (and admin/agent registrations).
    discovery: Type.Optional(DiscoveryConfig),
    // Sent as `Authorization: Bearer …` to engines started with `--api-key`.
    upstreamApiKey: Type.Optional(Type.String({ minLength: 1 })),
    shutdownGraceMs: Type.Integer({ minimum: 0, default: 30000 }),
  },
  { $id: 'RouterConfig', additionalProperties: false },
)
export type RouterConfig = Omit<Static<typeof RouterConfig>, 'instances'> & { instances: InstanceConfig[] }
