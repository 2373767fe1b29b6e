import type { Clock } from '../../common/clock.js'
import { errorWithDetails } from '../../common/coded-error.js'
import type { Random } from '../../common/random.js'
import { sleep } from '../../common/timers.js'
import { isAgentCallError } from './agent-client.js'
import type { BlockPool } from './block-pool.js'
import { SIM_ERR_AGENT_NOT_READY, SIM_ERR_KV_LEASE_FAILED, SIM_ERR_NUM_TOKENS_MISMATCH, simErrors } from './errors.js'
import { prefillAndGenerate, tokensFromKv } from './generator.js'
import type { KvRegion } from './kv-region.js'
import { parseRemoteKv, type KvTransport, type RemoteKv } from './kv-source.js'
import type { SimMetrics } from './metrics.js'
import type { PromptInput } from './prompt.js'
import { applyStop, type Finished } from './stop.js'

export type Role = 'prefill' | 'decode' | 'both'

/** How a request was served: the log and tests read it. */
export type ServeMode = 'prefill' | 'remote-decode' | 'local'

export interface EngineOptions {
  role: Role
  engineId: string
  kvMode: 'none' | 'agent'
  /** SimConfig.vllmCompat: `legacy` imitates vLLM before remote_request_id. */
  vllmCompat: 'current' | 'legacy'
  prefillDelayMs: number
  /** A decode leg's wait before it loads its KV (SimConfig.decodeQueueMs). */
  decodeQueueMs?: number
  /** Tell the agent about the pull while waiting (SimConfig.announcePulls, default true). */
  announcePulls?: boolean
  /** The lease, for how often to say it again (lease/6, vLLM's heartbeat interval). */
  leaseSeconds?: number
  sideChannelHost: string
  sideChannelPort: number
  clock: Clock
  random: Random
  region: KvRegion
  pool: BlockPool
  metrics: SimMetrics
  /** Present in `--kv agent` mode only: leases (P) and pulls (D) through the transfer agent. */
  kv?: KvTransport
  /** vLLM's kv_load_failure_policy: what a failed pull does to its request. */
  kvLoadFailurePolicy: 'fail' | 'recompute'
}

/** How a decode leg got its KV in `--kv agent` mode (the request log shows it). */
export interface KvLoad {
  outcome: 'ok' | 'recomputed'
  /** Why the pull failed: the agent's code (XFA_ERR_*), or the socket's. */
  agentCode?: string
}

/** SIM_ERR_KV_LOAD_FAILED with the agent's code, for the route and the request log. */
export type KvLoadFailure = Error & { code: 'SIM_ERR_KV_LOAD_FAILED'; agentCode: string }

export function isKvLoadFailure(err: unknown): err is KvLoadFailure {
  return err instanceof simErrors.SIM_ERR_KV_LOAD_FAILED
}

export interface EngineRequest {
  /** vLLM's response id (`cmpl-<X-Request-Id>`); the internal id appends 8 random chars. */
  responseId: string
  input: PromptInput
  kvTransferParams: Record<string, unknown> | null | undefined
  signal: AbortSignal
  log: { warn(obj: object, msg: string): void; info(obj: object, msg: string): void }
  /** Fault injection (`kvLoadFailureRate`): a decode leg's KV load fails without being tried. */
  failKvLoad?: boolean
  /**
   * vLLM's skip_reading_prefix_cache: set for requests with prompt_logprobs, which need every
   * prompt position computed. Nothing hits, nothing is counted as a query; blocks are cached.
   */
  skipReadingPrefixCache?: boolean
}

export interface EngineResult {
  internalId: string
  mode: ServeMode
  promptTokens: number
  /** Prompt tokens this engine found in its own prefix cache (its metrics count these). */
  cachedTokens: number
  /**
   * What usage.prompt_tokens_details.cached_tokens says: cachedTokens, except on a decode leg
   * whose P sent `remote_prefill_cached_tokens` (vLLM 0.32 reports P's hits there, not D's).
   */
  reportedCachedTokens: number
  /** Every output token and the text, stop criteria applied; the route paces them out. */
  output: Finished
  kvTransferParams: Record<string, unknown> | null
  kvLoad?: KvLoad
}

/** A prompt's blocks: its cached prefix (`hit` blocks, referenced) then fresh ones. */
interface PromptBlocks {
  blocks: number[]
  hit: number
  /** The positions the hit covers: hit × blockSize. */
  cachedTokens: number
  hashes: bigint[]
}

/** A prompt's output, and how many of its tokens came from this engine's cache. */
interface Computed {
  output: number[]
  cachedTokens: number
}

/**
 * The simulated engine: prefill writes real KV bytes into allocated blocks, and the output
 * is generated from the digest of the blocks held. The P/D behaviour follows vLLM's
 * NixlPullConnector (protocol reference §1.2–§1.4). Every path goes through the prefix
 * cache, as vLLM's scheduler does: a hit skips that part of the prefill, or of D's pull.
 */
export class SimEngine {
  readonly #o: EngineOptions

  constructor(opts: EngineOptions) {
    this.#o = opts
  }

  get engineId(): string {
    return this.#o.engineId
  }

  async run(req: EngineRequest): Promise<EngineResult> {
    const o = this.#o
    const started = o.clock.monotonic()
    o.metrics.promptTokens.inc(o.metrics.labels, req.input.tokens.length)
    // vLLM appends 8 random chars to every id (InputProcessor.assign_request_id); older
    // releases did not, so both legs of one X-Request-Id had the same id.
    const internalId = o.vllmCompat === 'legacy' ? req.responseId : `${req.responseId}-${o.random.hex(4)}`
    const result = await this.#serve(req, internalId)
    const external = result.mode === 'remote-decode' && (result.kvLoad === undefined || result.kvLoad.outcome === 'ok')
    const bySource = (source: string, n: number): void => o.metrics.promptTokensBySource.inc({ ...o.metrics.labels, source }, n)
    bySource('local_cache_hit', result.cachedTokens)
    bySource(external ? 'external_kv_transfer' : 'local_compute', result.promptTokens - result.cachedTokens)
    // Every leg has its first token once #serve returns; failed requests record no TTFT.
    o.metrics.ttft.observe(o.metrics.labels, (o.clock.monotonic() - started) / 1000)
    return result
  }

  async #serve(req: EngineRequest, internalId: string): Promise<EngineResult> {
    const o = this.#o
    const params = req.kvTransferParams ?? undefined
    const { tokens, maxTokens, stop } = req.input

    if (params?.do_remote_decode === true) {
      if (o.role !== 'decode') return this.#prefillLeg(req, internalId)
      req.log.warn({ internalId }, 'do_remote_decode sent to a decode-only simulator; serving locally')
    }

    let computed: Computed | undefined
    let mode: ServeMode = 'local'
    let kvLoad: KvLoad | undefined
    if (params?.do_remote_prefill === true) {
      if (o.role === 'prefill') {
        req.log.warn({ internalId }, 'do_remote_prefill sent to a prefill-only simulator; serving locally')
      } else {
        // Not a vLLM check: a router that changed the prompt between legs would otherwise
        // go unnoticed in `--kv none` mode, where D never reads P's bytes.
        const remoteNum = params.remote_num_tokens
        if (typeof remoteNum === 'number' && remoteNum !== tokens.length) {
          throw new SIM_ERR_NUM_TOKENS_MISMATCH(remoteNum, tokens.length)
        }
        const remote = parseRemoteKv(params, o.vllmCompat === 'legacy' ? { legacyRequestId: internalId } : {})
        if ('missing' in remote) {
          req.log.warn({ internalId, missing: remote.missing, kvTransferParams: params }, 'Got invalid KVTransferParams')
        } else if (req.failKvLoad) {
          const injected = this.#loadFailed(req, internalId, new Error('injected KV load failure (kvLoadFailureRate)'), 'SIM_INJECTED')
          kvLoad = { outcome: 'recomputed', agentCode: injected.recompute }
        } else if (o.kv) {
          const pulled = await this.#pullAndGenerate(o.kv, remote, req, internalId)
          if (!('recompute' in pulled)) {
            computed = pulled
            mode = 'remote-decode'
            kvLoad = { outcome: 'ok' }
          } else {
            // kv_load_failure_policy=recompute: prefill here, below, paying the prefill delay.
            kvLoad = { outcome: 'recomputed', agentCode: pulled.recompute }
          }
        } else {
          // `--kv none`: the blocks are not read; D computes the same KV itself, so the
          // text equals the oracle's, without paying the prefill delay a real D skips too.
          // A busy decoder still queues the request first.
          await sleep(o.clock, o.decodeQueueMs ?? 0, req.signal)
          computed = await this.#computeLocally(tokens, maxTokens, 0, req)
          mode = 'remote-decode'
        }
      }
    }
    computed ??= await this.#computeLocally(tokens, maxTokens, o.prefillDelayMs, req)
    const remoteCached = params?.do_remote_prefill === true && Number.isInteger(params.remote_prefill_cached_tokens) ? (params.remote_prefill_cached_tokens as number) : undefined
    const result: EngineResult = {
      internalId,
      mode,
      promptTokens: tokens.length,
      cachedTokens: computed.cachedTokens,
      reportedCachedTokens: remoteCached ?? computed.cachedTokens,
      output: applyStop(computed.output, stop),
      kvTransferParams: null,
    }
    if (kvLoad) result.kvLoad = kvLoad
    return result
  }

  /** P leg: prefill into blocks, keep them under a lease (agent mode), answer with the params. */
  async #prefillLeg(req: EngineRequest, internalId: string): Promise<EngineResult> {
    const o = this.#o
    const { tokens, maxTokens, stop } = req.input
    // Without the agent there is nobody to lease to nor an address to export: refuse before
    // spending the prefill (a router retries a 503 elsewhere).
    if (o.kv && !o.kv.ready) throw new SIM_ERR_AGENT_NOT_READY('a prefill leg needs its lease')
    const prompt = this.#acquire(tokens, req.skipReadingPrefixCache)
    const { blocks, cachedTokens } = prompt
    let output: Finished
    try {
      output = applyStop(await this.#prefill(prompt, tokens, maxTokens, o.prefillDelayMs, req.signal), stop)
    } catch (err) {
      // An aborted prefill frees its blocks and returns no params, as vLLM does.
      o.pool.free(blocks)
      throw err
    }
    const served = { internalId, mode: 'prefill' as const, promptTokens: tokens.length, cachedTokens, reportedCachedTokens: cachedTokens, output }
    if (output.finishReason !== 'length') {
      // vLLM's connector delays the free and returns params only for FINISHED_LENGTH_CAPPED:
      // a stop string, stop token or EOS frees the blocks now and D must prefill again.
      o.pool.free(blocks)
      req.log.info({ internalId, finishReason: output.finishReason, stopReason: output.stopReason }, 'prefill finished by stop: no kv_transfer_params')
      return { ...served, kvTransferParams: null }
    }
    let expiry: number | null = null
    let host = o.sideChannelHost
    let port = o.sideChannelPort
    if (!o.kv) {
      // Nobody reads the blocks in `--kv none` mode (D recomputes), so pinning them would
      // only leak capacity.
      o.pool.free(blocks)
    } else {
      // The agent owns the blocks from here: it frees them when the lease ends (read done,
      // released or expired), or now if leasing failed.
      try {
        expiry = await o.kv.lease(internalId, blocks)
      } catch (err) {
        throw new SIM_ERR_KV_LEASE_FAILED(internalId, (err as Error).message, { cause: err })
      }
      if (req.signal.aborted) {
        // The client left while we leased: nobody will read these blocks.
        o.kv.release(internalId)
        throw req.signal.reason
      }
      // Decoders' agents handshake with ours, not with this engine.
      host = o.kv.peer?.host ?? host
      port = o.kv.peer?.port ?? port
    }
    if (o.vllmCompat === 'legacy') {
      // The shape before NIXL_CONNECTOR_VERSION 2: no remote_request_id (D uses its own id,
      // equal to ours), a flat block list, none of the later fields.
      const legacy: Record<string, unknown> = {
        do_remote_prefill: true,
        do_remote_decode: false,
        remote_block_ids: blocks,
        remote_engine_id: o.engineId,
        remote_host: host,
        remote_port: port,
        tp_size: 1,
      }
      // The agent's lease deadline is handoff's, not vLLM's: agent mode keeps it.
      if (o.kv) legacy.remote_blocks_expiry_time = expiry
      return { ...served, kvTransferParams: legacy }
    }
    const kvTransferParams = {
      do_remote_prefill: true,
      do_remote_decode: false,
      remote_block_ids: [blocks],
      remote_engine_id: o.engineId,
      remote_request_id: internalId,
      remote_host: host,
      remote_port: port,
      tp_size: 1,
      dcp_size: 1,
      pp_size: 1,
      remote_num_tokens: tokens.length,
      // vLLM's P sends null; in agent mode the P agent's lease deadline, seconds on the
      // agent's monotonic clock (vLLM: the producer's perf_counter), exported verbatim.
      remote_blocks_expiry_time: expiry,
      transfer_mode: 'pull',
      // vLLM 0.32's scheduler adds P's prefix hits, for D to report as its cached_tokens.
      remote_prefill_cached_tokens: cachedTokens,
    }
    return { ...served, kvTransferParams }
  }

  /**
   * The prompt's blocks: its cached prefix then fresh ones. At most all but the last token
   * hit, as in vLLM (KVCacheManager.get_computed_blocks): the last one is always computed,
   * for its logits.
   */
  #acquire(tokens: Uint32Array, skipReading = false): PromptBlocks {
    const o = this.#o
    const hashes = o.pool.hashes(tokens)
    const maxHit = skipReading ? 0 : Math.floor((tokens.length - 1) / o.region.blockSize)
    const { blocks, hit } = o.pool.acquire(hashes, o.region.blocksFor(tokens.length), maxHit)
    const cachedTokens = hit * o.region.blockSize
    if (o.pool.enableCaching && !skipReading) {
      o.metrics.prefixCacheQueries.inc(o.metrics.labels, tokens.length)
      o.metrics.prefixCacheHits.inc(o.metrics.labels, cachedTokens)
    }
    return { blocks, hit, cachedTokens, hashes }
  }

  /**
   * Computes the uncached part of the prompt into its blocks, taking `delayMs` for a whole
   * prompt (a hit shortens it by its share), caches the full blocks and generates.
   */
  async #prefill(prompt: PromptBlocks, tokens: Uint32Array, maxTokens: number, delayMs: number, signal: AbortSignal): Promise<number[]> {
    const o = this.#o
    const from = prompt.cachedTokens
    await sleep(o.clock, (delayMs * (tokens.length - from)) / tokens.length, signal)
    const output = prefillAndGenerate(o.region, prompt.blocks, tokens, maxTokens, from)
    o.pool.cache(prompt.blocks, prompt.hashes, tokens, prompt.hit)
    return output
  }

  /** Prefill here, generate, free: the blocks stay cached, the engine keeps only the output. */
  async #computeLocally(tokens: Uint32Array, maxTokens: number, delayMs: number, req: EngineRequest): Promise<Computed> {
    const o = this.#o
    const prompt = this.#acquire(tokens, req.skipReadingPrefixCache)
    try {
      return { output: await this.#prefill(prompt, tokens, maxTokens, delayMs, req.signal), cachedTokens: prompt.cachedTokens }
    } finally {
      o.pool.free(prompt.blocks)
    }
  }

  /**
   * D leg in `--kv agent` mode: pull what D's own prefix cache lacks into fresh blocks (the
   * tail of P's, as vLLM's NIXL connector reads remote_block_ids[-len(local):]), cache them
   * and generate. A failed pull fails the request (policy `fail`) or asks for a local prefill
   * (`recompute`, the agent's code returned). Fresh blocks of a failed pull belong to the
   * transport (it frees them once no READ can write into them); this frees the hit's
   * references, and every block of a pull that succeeded.
   */
  async #pullAndGenerate(kv: KvTransport, remote: RemoteKv, req: EngineRequest, internalId: string): Promise<Computed | { recompute: string }> {
    const o = this.#o
    const { tokens, maxTokens } = req.input
    const n = o.region.blocksFor(tokens.length)
    let failure: Error
    let agentCode: string
    if (remote.blockIds.length < n) {
      // A P that exported fewer blocks than the prompt needs: nothing to READ the rest from.
      agentCode = 'SIM_REMOTE_BLOCKS_SHORT'
      failure = new Error(`P exported ${remote.blockIds.length} block ids, the prompt needs ${n}`)
    } else {
      await this.#queue(kv, remote, req.signal)
      const { blocks, hit, cachedTokens, hashes } = this.#acquire(tokens, req.skipReadingPrefixCache)
      try {
        const tail = { ...remote, blockIds: remote.blockIds.slice(hit, n) }
        await kv.pull({ requestId: internalId, remote: tail, localBlocks: blocks.slice(hit), numTokens: tokens.length - cachedTokens, signal: req.signal })
      } catch (err) {
        o.pool.free(blocks.slice(0, hit))
        // The client left or the app is closing: nobody to answer, no policy to apply.
        if (req.signal.aborted) throw req.signal.reason
        failure = err as Error
        agentCode = isAgentCallError(err) ? err.agentCode : String((err as { code?: unknown }).code ?? 'UNKNOWN')
        return this.#loadFailed(req, internalId, failure, agentCode)
      }
      try {
        o.pool.cache(blocks, hashes, tokens, hit)
        return { output: tokensFromKv(o.region, blocks, tokens.length, maxTokens), cachedTokens }
      } finally {
        o.pool.free(blocks)
      }
    }
    return this.#loadFailed(req, internalId, failure, agentCode)
  }

  /**
   * A busy decoder's wait before the pull (decodeQueueMs), telling the agent it will pull
   * every lease/6 meanwhile, as vLLM's scheduler heartbeats a waiting request.
   */
  async #queue(kv: KvTransport, remote: RemoteKv, signal: AbortSignal): Promise<void> {
    const o = this.#o
    const waitMs = o.decodeQueueMs ?? 0
    if (waitMs <= 0) return
    const end = o.clock.monotonic() + waitMs
    const everyMs = ((o.leaseSeconds ?? 30) * 1000) / 6
    while (o.clock.monotonic() < end) {
      if (o.announcePulls !== false) kv.expect?.(remote)
      await sleep(o.clock, Math.min(everyMs, end - o.clock.monotonic()), signal)
    }
  }

  #loadFailed(req: EngineRequest, internalId: string, failure: Error, agentCode: string): { recompute: string } {
    const o = this.#o
    o.metrics.failedTransfers.inc(o.metrics.labels)
    if (o.kvLoadFailurePolicy === 'fail') {
      throw errorWithDetails(simErrors, 'SIM_ERR_KV_LOAD_FAILED', `${agentCode}: ${failure.message}`, { agentCode, cause: failure }) as KvLoadFailure
    }
    o.metrics.kvRecomputed.inc(o.metrics.labels)
    req.log.warn({ internalId, agentCode, err: failure }, 'KV load failed; recomputing the prompt (kv_load_failure_policy=recompute)')
    return { recompute: agentCode }
  }
}
