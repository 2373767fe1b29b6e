import Type, { type Static } from 'typebox'

/** The engine simulator's settings (`handoff sim` flags map onto these). */
export const SimConfig = Type.Object(
  {
    role: Type.Union([Type.Literal('prefill'), Type.Literal('decode'), Type.Literal('both')], { default: 'both' }),
    host: Type.String({ default: '127.0.0.1' }),
    port: Type.Integer({ minimum: 0, maximum: 65535, default: 0 }),
    model: Type.String({ minLength: 1, default: 'handoff/sim-1' }),
    // One per process incarnation, like vLLM's generated uuid; fixed only when asked.
    engineId: Type.Optional(Type.String({ minLength: 1 })),
    // vLLM's --data-parallel-size: with more than one rank every rank is its own engine,
    // named `<engineId>_dp<rank>` (vLLM 0.32 v1/engine/core.py run_engine_core), its side
    // channel at sideChannelPort + rank. Without dataParallelRank the process serves every
    // rank behind its one port (vLLM's internal load balancing; `--kv none` only: each rank
    // would need its own transfer agent).
    dataParallelSize: Type.Integer({ minimum: 1, maximum: 64, default: 1 }),
    // vLLM's --data-parallel-rank (external load balancing): this process is that one rank
    // of dataParallelSize, with its own API server; a load balancer fronts the ranks.
    dataParallelRank: Type.Optional(Type.Integer({ minimum: 0, maximum: 63 })),
    // `none`: D computes the prompt's KV itself; `agent`: KV moves through transfer agents.
    kv: Type.Union([Type.Literal('none'), Type.Literal('agent')], { default: 'none' }),
    // `--kv agent`: the transfer agent's loopback API (required in that mode; sim/src/config.ts
    // checks it). Decoders are told to handshake with the agent, so in this mode
    // remote_host/remote_port come from the agent's attach answer, not sideChannelHost/Port.
    agentUrl: Type.Optional(Type.String({ pattern: '^https?://[^/]+/?$' })),
    // Sent as `Authorization: Bearer <token>` when the agent was started with one.
    agentToken: Type.Optional(Type.String({ minLength: 1 })),
    // The POSIX shared-memory object holding the KV region, which the agent maps and
    // registers with NIXL; default `/handoff-kv-<engineId>-<pid>`, unlinked on close.
    shmName: Type.Optional(Type.String({ minLength: 2, maxLength: 250, pattern: '^/[^/]+$' })),
    // vLLM's kv_load_failure_policy: a failed KV pull fails the request (`fail`, vLLM's
    // default) or the decoder prefills the prompt itself (`recompute`).
    kvLoadFailurePolicy: Type.Union([Type.Literal('fail'), Type.Literal('recompute')], { default: 'fail' }),
    leaseSeconds: Type.Number({ exclusiveMinimum: 0, default: 30 }),
    blockSize: Type.Integer({ minimum: 1, maximum: 1024, default: 16 }),
    // vLLM's --num-gpu-blocks-override: the KV pool's size in blocks of blockSize tokens.
    numGpuBlocksOverride: Type.Integer({ minimum: 1, default: 16384 }),
    // vLLM's --enable-prefix-caching (on by default in vLLM v1; `--no-enable-prefix-caching`):
    // a freed full block keeps its hash until evicted, and a prompt that shares it skips that
    // part of the prefill (sim/src/block-pool.ts).
    enablePrefixCaching: Type.Boolean({ default: true }),
    // vLLM's --enable-prompt-tokens-details: usage.prompt_tokens_details.cached_tokens.
    enablePromptTokensDetails: Type.Boolean({ default: false }),
    // vLLM's --kv-events-config: a JSON object (schemas/kv-events.ts). With
    // enable_kv_cache_events the pool's BlockStored/BlockRemoved/AllBlocksCleared go out on a
    // ZMQ PUB socket in vLLM 0.32's wire form (sim/src/kv-events.ts).
    kvEventsConfig: Type.Optional(Type.String({ minLength: 2 })),
    // A multiple of 8 so each position's bytes are whole 32-bit words (sim/src/kv-bytes.ts).
    bytesPerToken: Type.Integer({ minimum: 8, maximum: 65536, multipleOf: 8, default: 32 }),
    maxModelLen: Type.Integer({ minimum: 1, default: 131072 }),
    defaultMaxTokens: Type.Integer({ minimum: 1, default: 16 }),
    prefillDelayMs: Type.Number({ minimum: 0, default: 0 }),
    decodeDelayMs: Type.Number({ minimum: 0, default: 0 }),
    // A decode leg waits this long before it loads its KV, as a busy vLLM decoder queues a
    // request (WAITING_FOR_REMOTE_KVS); with `--kv none` before it computes the KV itself.
    // With `--kv agent` it tells its agent meanwhile it will pull (every lease/6, as vLLM's
    // scheduler heartbeats such a request), unless skipPullExpectations: then the wait gets
    // no heartbeat credit (before issue 17 item 4).
    decodeQueueMs: Type.Number({ minimum: 0, default: 0 }),
    skipPullExpectations: Type.Boolean({ default: false }),
    // vLLM's max_num_seqs: requests running at once; more wait (vllm:num_requests_waiting).
    // vLLM's default for its API server on a GPU of 70 GiB or more (H100, H200) is 1024.
    maxNumSeqs: Type.Integer({ minimum: 1, default: 1024 }),
    // Advertised as remote_host/remote_port (vLLM: VLLM_NIXL_SIDE_CHANNEL_HOST/PORT).
    sideChannelHost: Type.String({ default: '127.0.0.1' }),
    sideChannelPort: Type.Integer({ minimum: 0, maximum: 65535, default: 5600 }),
    // Which vLLM the simulator imitates. `legacy`: releases before remote_request_id (vLLM PR
    // #29665, late 2025): no random suffix on request ids, P's params without
    // remote_request_id and with a flat remote_block_ids, and D takes P's request id to be
    // its own (the same X-Request-Id on both legs).
    // vLLM's --api-key: every path under /v1 needs `Authorization: Bearer <key>`; /health,
    // /metrics and /sim/* stay open.
    apiKey: Type.Optional(Type.String({ minLength: 1 })),
    vllmCompat: Type.Union([Type.Literal('current'), Type.Literal('legacy')], { default: 'current' }),
    faults: Type.Object(
      {
        errorRate: Type.Number({ minimum: 0, maximum: 1, default: 0 }),
        stallRate: Type.Number({ minimum: 0, maximum: 1, default: 0 }),
        stallMs: Type.Number({ minimum: 0, default: 60000 }),
        // Exit the process (as a crash) when this many requests have been accepted.
        crashAfter: Type.Optional(Type.Integer({ minimum: 1 })),
        // 200 with a body that is not JSON.
        garbageRate: Type.Number({ minimum: 0, maximum: 1, default: 0 }),
        // Destroy the socket after the headers (and the first SSE chunk when streaming).
        disconnectRate: Type.Number({ minimum: 0, maximum: 1, default: 0 }),
        // A decode leg's KV load fails as a failed pull does: kv_load_failure_policy decides
        // (fail: 500, or 200 and an error event when streamed, as vLLM; recompute: D prefills).
        kvLoadFailureRate: Type.Number({ minimum: 0, maximum: 1, default: 0 }),
        // GET /health answers 503, like vLLM after EngineDeadError.
        unhealthy: Type.Boolean({ default: false }),
        // GET /health answers this many ms late, as vLLM's does under load: its handler waits
        // behind the API server's output loop on one asyncio loop (vllm-project/vllm#38157
        // measured 30-40 s), while the requests in flight keep streaming.
        healthDelayMs: Type.Integer({ minimum: 0, default: 0 }),
        // The model samples its EOS token (sim/src/stop.ts EOS_TOKEN_ID) as output token N
        // (1-based) unless the request sets ignore_eos; absent: never.
        eosAfterTokens: Type.Optional(Type.Integer({ minimum: 1 })),
      },
      { default: {}, additionalProperties: false },
    ),
    seed: Type.Optional(Type.Integer()),
    // Idle keep-alive connections are closed after this long: uvicorn's default
    // (timeout_keep_alive, 5 s), which vLLM does not change.
    keepAliveMs: Type.Integer({ minimum: 1, default: 5000 }),
    // Request bodies above this many bytes get 413 (200 KiB prompts must fit with room to spare).
    bodyLimit: Type.Integer({ minimum: 1024, default: 16 * 1024 * 1024 }),
    logLevel: Type.String({ default: 'info' }),
  },
  { $id: 'SimConfig', additionalProperties: false },
)
export type SimConfig = Static<typeof SimConfig>
