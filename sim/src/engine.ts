import type { Clock } from '../../common/clock.js'
import type { LeaseTable } from '../../common/lease-table.js'
import type { Random } from '../../common/random.js'
import { sleep } from '../../common/timers.js'
import type { BlockAllocator } from './block-allocator.js'
import { SIM_ERR_NUM_TOKENS_MISMATCH } from './errors.js'
import { prefillAndGenerate, tokensFromKv } from './generator.js'
import type { KvRegion } from './kv-region.js'
import { parseRemoteKv, type KvSource, type RemoteKv } from './kv-source.js'
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
  sideChannelHost: string
  sideChannelPort: number
  clock: Clock
  random: Random
  region: KvRegion
  allocator: BlockAllocator
  leases: LeaseTable<readonly number[]>
  metrics: SimMetrics
  /** Present in `--kv agent` mode only. */
  kvSource?: KvSource
}

export interface EngineRequest {
  /** vLLM's response id (`cmpl-<X-Request-Id>`); the internal id appends 8 random chars. */
  responseId: string
  input: PromptInput
  kvTransferParams: Record<string, unknown> | null | undefined
  signal: AbortSignal
  log: { warn(obj: object, msg: string): void; info(obj: object, msg: string): void }
}

export interface EngineResult {
  internalId: string
  mode: ServeMode
  promptTokens: number
  /** Every output token and the text, stop criteria applied; the route paces them out. */
  output: Finished
  kvTransferParams: Record<string, unknown> | null
}

/**
 * The simulated engine: prefill writes real KV bytes into allocated blocks, and the output
 * is generated from the digest of the blocks held. The P/D behaviour follows vLLM's
 * NixlPullConnector (protocol reference §1.2–§1.4).
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

    let outputTokens: number[] | undefined
    let mode: ServeMode = 'local'
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
        } else if (o.kvSource) {
          outputTokens = await this.#pullAndGenerate(o.kvSource, remote, req)
          mode = 'remote-decode'
        } else {
          // `--kv none`: the blocks are not read; D computes the same KV itself, so the
          // text equals the oracle's, without paying the prefill delay a real D skips too.
          outputTokens = this.#computeLocally(tokens, maxTokens)
          mode = 'remote-decode'
        }
      }
    }
    if (!outputTokens) {
      await sleep(o.clock, o.prefillDelayMs, req.signal)
      outputTokens = this.#computeLocally(tokens, maxTokens)
    }
    return { internalId, mode, promptTokens: tokens.length, output: applyStop(outputTokens, stop), kvTransferParams: null }
  }

  /** P leg: prefill into blocks, keep them under a lease (agent mode), answer with the params. */
  async #prefillLeg(req: EngineRequest, internalId: string): Promise<EngineResult> {
    const o = this.#o
    const { tokens, maxTokens, stop } = req.input
    const blocks = o.allocator.allocate(o.region.blocksFor(tokens.length))
    let output: Finished
    try {
      await sleep(o.clock, o.prefillDelayMs, req.signal)
      output = applyStop(prefillAndGenerate(o.region, blocks, tokens, maxTokens), stop)
    } catch (err) {
      // An aborted prefill frees its blocks and returns no params, as vLLM does.
      o.allocator.free(blocks)
      throw err
    }
    if (output.finishReason !== 'length') {
      // vLLM's connector delays the free and returns params only for FINISHED_LENGTH_CAPPED:
      // a stop string, stop token or EOS frees the blocks now and D must prefill again.
      o.allocator.free(blocks)
      req.log.info({ internalId, finishReason: output.finishReason, stopReason: output.stopReason }, 'prefill finished by stop: no kv_transfer_params')
      return { internalId, mode: 'prefill', promptTokens: tokens.length, output, kvTransferParams: null }
    }
    let expiry: number | null = null
    if (o.kvMode === 'none') {
      // Nobody reads the blocks in `--kv none` mode (D recomputes), so pinning them would
      // only leak capacity until the lease expired.
      o.allocator.free(blocks)
    } else {
      o.leases.pin(internalId, blocks)
      expiry = (o.leases.expiresAtWall(internalId) ?? 0) / 1000
    }
    if (o.vllmCompat === 'legacy') {
      // The shape before NIXL_CONNECTOR_VERSION 2: no remote_request_id (D uses its own id,
      // equal to ours), a flat block list, none of the later fields.
      const legacy: Record<string, unknown> = {
        do_remote_prefill: true,
        do_remote_decode: false,
        remote_block_ids: blocks,
        remote_engine_id: o.engineId,
        remote_host: o.sideChannelHost,
        remote_port: o.sideChannelPort,
        tp_size: 1,
      }
      // The agent's lease deadline is handoff's, not vLLM's: agent mode keeps it.
      if (o.kvMode === 'agent') legacy.remote_blocks_expiry_time = expiry
      return { internalId, mode: 'prefill', promptTokens: tokens.length, output, kvTransferParams: legacy }
    }
    const kvTransferParams = {
      do_remote_prefill: true,
      do_remote_decode: false,
      remote_block_ids: [blocks],
      remote_engine_id: o.engineId,
      remote_request_id: internalId,
      remote_host: o.sideChannelHost,
      remote_port: o.sideChannelPort,
      tp_size: 1,
      dcp_size: 1,
      pp_size: 1,
      remote_num_tokens: tokens.length,
      // vLLM's P sends null; in agent mode the P agent's lease deadline (wall seconds).
      remote_blocks_expiry_time: expiry,
      transfer_mode: 'pull',
    }
    return { internalId, mode: 'prefill', promptTokens: tokens.length, output, kvTransferParams }
  }

  /** Prefill into scratch blocks, digest, free: the decoder keeps only the digest while decoding. */
  #computeLocally(tokens: Uint32Array, maxTokens: number): number[] {
    const o = this.#o
    const blocks = o.allocator.allocate(o.region.blocksFor(tokens.length))
    try {
      return prefillAndGenerate(o.region, blocks, tokens, maxTokens)
    } finally {
      o.allocator.free(blocks)
    }
  }

  async #pullAndGenerate(source: KvSource, remote: RemoteKv, req: EngineRequest): Promise<number[]> {
    const o = this.#o
    const { tokens, maxTokens } = req.input
    const blocks = o.allocator.allocate(o.region.blocksFor(tokens.length))
    try {
      await source.pull(remote, o.region, blocks, tokens.length, req.signal)
      return tokensFromKv(o.region, blocks, tokens.length, maxTokens)
    } catch (err) {
      o.metrics.failedTransfers.inc(o.metrics.labels)
      throw err
    } finally {
      o.allocator.free(blocks)
    }
  }
}
