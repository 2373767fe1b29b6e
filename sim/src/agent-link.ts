import type { Logger } from 'pino'
import type { Clock } from '../../common/clock.js'
import { deferred } from '../../common/deferred.js'
import { sleep } from '../../common/timers.js'
import type { AgentAttach, AgentEvent } from '../../schemas/agent-api.js'
import { isAgentCallError, type AgentClient } from './agent-client.js'
import type { BlockPool } from './block-pool.js'
import { SIM_ERR_AGENT_NOT_READY } from './errors.js'
import type { KvPull, KvTransport, RemoteKv } from './kv-source.js'
import type { SimMetrics } from './metrics.js'

export interface AgentLinkOptions {
  client: AgentClient
  /** The attach body: this engine and its shared-memory KV region. */
  attach: AgentAttach
  pool: BlockPool
  metrics: SimMetrics
  clock: Clock
  log: Logger
  /** The simulator's --lease-seconds: only compared with the agent's, which governs. */
  leaseSeconds?: number
  /** Long-poll wait of the events loop (ms). */
  pollWaitMs?: number
  /** Backoff bounds after a failed poll or attach (ms). */
  backoffMinMs?: number
  backoffMaxMs?: number
}

interface TaintedPull {
  blocks: readonly number[]
}

/**
 * The engine's link to its transfer agent (`--kv agent`): attach, lease (prefiller), pull
 * (decoder), and ONE events loop for the engine's lifetime that frees blocks when the agent
 * says so. Rules that keep the KV honest:
 * - A leased block is freed only on `lease_ended`, and at once (LIFO reuse makes a stale
 *   read visible). An agent restart (another agentId) never frees one: a decoder may still
 *   read it; the engine attaches again and leases every block it holds afresh.
 * - A failed or aborted pull's blocks are freed only once no READ can write into them: on the
 *   agent's `pull_quiesced` (sent for every pull that did not succeed), or when the agent
 *   that ran it is gone (a restart: its READs died with its process), or at once when the
 *   call provably never started a READ (no connection, rejected body, not attached).
 * - Every block is freed exactly once: each lives in one map (held, tainted) until freed.
 */
export class AgentLink implements KvTransport {
  readonly #o: AgentLinkOptions
  readonly #client: AgentClient
  readonly #stop = new AbortController()
  readonly #held = new Map<string, readonly number[]>()
  // Held blocks whose first lease call is still running: that call (retried after a
  // re-attach) leases them, not the re-attach.
  readonly #leasing = new Set<string>()
  readonly #tainted = new Map<string, TaintedPull>()
  // Pulls waiting for their answer: `pull_quiesced` may overtake the failure it follows.
  readonly #pulling = new Map<string, { quiesced: boolean }>()
  readonly #firstAttach = deferred<void>()
  #agentId: string | undefined
  // The attach body now, and the one the agent last accepted (another once the URL is known).
  #body: AgentAttach
  #attachedBody: AgentAttach | undefined
  #peer: { host: string; port: number } | undefined
  #synced = false
  #outage = false
  #after = 0
  // Bumped by every (re-)attach: a poll answer from before it belongs to the old agent.
  #gen = 0
  #resyncing: Promise<void> | undefined
  #loop: Promise<void> | undefined

  constructor(opts: AgentLinkOptions) {
    this.#o = opts
    this.#client = opts.client
    this.#body = opts.attach
    // Nobody may be waiting (the events loop retries by itself).
    this.#firstAttach.promise.catch(() => undefined)
  }

  get ready(): boolean {
    return this.#synced && !this.#outage
  }

  get peer(): { host: string; port: number } | undefined {
    return this.#peer
  }

  get agentId(): string | undefined {
    return this.#agentId
  }

  get leases(): number {
    return this.#held.size
  }

  get taintedBlocks(): number {
    let n = 0
    for (const t of this.#tainted.values()) n += t.blocks.length
    return n
  }

  /**
   * The engine's URL, known once it listens (port 0): attaches again with it, so the agent
   * can tell the router which instance it serves. Not ready (/health 503) until the agent
   * has it; resolves once it has (or the link closed).
   */
  async setEngineUrl(url: string): Promise<void> {
    if (this.#body.engineUrl !== url) {
      this.#body = { ...this.#body, engineUrl: url }
      this.#synced = false
    }
    while (!this.#stop.signal.aborted && this.#attachedBody !== this.#body) {
      try {
        await this.#resync()
      } catch {
        // The events loop logs the outage; try again shortly.
        await sleep(this.#o.clock, 100, this.#stop.signal).catch(() => undefined)
      }
    }
  }

  /** Starts the events loop, which attaches first (and again whenever the agent restarts). */
  start(): void {
    this.#loop ??= this.#run()
  }

  /** Resolves after the first successful attach; rejects if the link closes before. */
  whenReady(): Promise<void> {
    return this.#firstAttach.promise
  }

  async close(): Promise<void> {
    this.#stop.abort()
    this.#firstAttach.reject(new SIM_ERR_AGENT_NOT_READY('the simulator is closing'))
    await this.#loop
    await this.#client.close()
  }

  async lease(requestId: string, blocks: readonly number[]): Promise<number> {
    // Held before the call: `lease_ended` may come before the answer does.
    this.#held.set(requestId, blocks)
    this.#leasing.add(requestId)
    try {
      const granted = await this.#reattaching(() => this.#client.lease({ requestId, blockIds: [...blocks] }, this.#stop.signal))
      return granted.expiresAt
    } catch (err) {
      if (this.#held.get(requestId) === blocks) {
        this.#held.delete(requestId)
        this.#o.pool.free(blocks)
      }
      // A lease the agent may have granted after all would pin these blocks there until it
      // expired (XFA_ERR_BLOCKS_LEASED for their next owner): end it.
      if (isAgentCallError(err) && err.sent && !(err.agentStatus !== undefined && err.agentStatus < 500)) this.release(requestId)
      throw err
    } finally {
      this.#leasing.delete(requestId)
    }
  }

  release(requestId: string): void {
    this.#client.release(requestId, this.#stop.signal).catch((err: unknown) => {
      this.#o.log.warn({ err, requestId }, 'releasing a lease failed; it ends at its expiry')
    })
  }

  expect(remote: RemoteKv): void {
    const body = { remoteEngineId: remote.remoteEngineId, remoteRequestId: remote.remoteRequestId, remoteHost: remote.remoteHost, remotePort: remote.remotePort }
    this.#client.expect(body, this.#stop.signal).catch((err: unknown) => {
      this.#o.log.debug({ err, remoteRequestId: remote.remoteRequestId }, 'telling the agent about a pull to come failed; its wait gets no heartbeat credit')
    })
  }

  async pull(job: KvPull): Promise<void> {
    const { remote, localBlocks, signal } = job
    const requestId = this.#pullId(job.requestId)
    const entry = { quiesced: false }
    this.#pulling.set(requestId, entry)
    const startedOn = this.#agentId
    const body = {
      requestId,
      remoteEngineId: remote.remoteEngineId,
      remoteRequestId: remote.remoteRequestId,
      remoteHost: remote.remoteHost,
      remotePort: remote.remotePort,
      remoteBlockIds: remote.blockIds.slice(0, localBlocks.length),
      remoteBlocksExpiryTime: remote.remoteBlocksExpiryTime,
      localBlockIds: [...localBlocks],
    }
    try {
      await this.#reattaching(() => this.#client.pull(body, AbortSignal.any([signal, this.#stop.signal])))
    } catch (err) {
      this.#settleFailedPull(requestId, localBlocks, err, entry.quiesced, startedOn)
      throw err
    } finally {
      this.#pulling.delete(requestId)
    }
  }

  /**
   * The id the agent knows a pull by. The engine's own id is unique except under
   * `--vllm-compat legacy`, where a retry reuses it while the first attempt may still be
   * tainted; a suffix keeps each pull's `pull_quiesced` its own.
   */
  #pullId(id: string): string {
    let out = id
    for (let n = 2; this.#pulling.has(out) || this.#tainted.has(out); n++) out = `${id}~${n}`
    return out
  }

  #settleFailedPull(requestId: string, blocks: readonly number[], err: unknown, quiesced: boolean, startedOn: string | undefined): void {
    const e = isAgentCallError(err) ? err : undefined
    const noRead =
      // The bytes arrived (200), only reading the answer failed.
      e?.agentStatus === 200 ||
      // The call never reached the agent, or it refused the call before starting a READ.
      (e !== undefined && !e.sent) ||
      e?.agentStatus === 400 ||
      e?.agentStatus === 401 ||
      e?.agentCode === 'XFA_ERR_NOT_ATTACHED' ||
      // The agent already reported this pull quiescent.
      quiesced ||
      // The socket broke and the agent that had the call has since been replaced.
      (e !== undefined && e.agentStatus === undefined && this.#synced && startedOn !== undefined && this.#agentId !== startedOn)
    if (noRead) {
      this.#o.pool.free(blocks)
      return
    }
    this.#tainted.set(requestId, { blocks })
    this.#o.log.warn({ requestId, blocks: blocks.length, agentCode: e?.agentCode }, 'failed pull: blocks held until the agent reports them quiescent')
  }

  /** Runs `call`; if the agent has no engine attached (it restarted), attaches and runs it once more. */
  async #reattaching<T>(call: () => Promise<T>): Promise<T> {
    try {
      return await call()
    } catch (err) {
      if (!isAgentCallError(err) || err.agentCode !== 'XFA_ERR_NOT_ATTACHED') throw err
      this.#synced = false
      try {
        await this.#resync()
      } catch {
        // The first answer stands: it says no work started (what a failed pull's blocks need).
        throw err
      }
      return call()
    }
  }

  /** The events loop: attach when needed, long-poll, apply, back off while the agent is away. */
  async #run(): Promise<void> {
    const { clock, log } = this.#o
    const minMs = this.#o.backoffMinMs ?? 100
    const maxMs = this.#o.backoffMaxMs ?? 1000
    let backoff = minMs
    while (!this.#stop.signal.aborted) {
      try {
        if (!this.#synced) await this.#resync()
        const gen = this.#gen
        const res = await this.#client.events(this.#after, this.#o.pollWaitMs ?? 1000, this.#stop.signal)
        if (gen !== this.#gen) continue
        if (res.agentId !== this.#agentId) {
          // Its events and `last` belong to the new agent, which knows nothing of ours yet.
          log.warn({ was: this.#agentId, now: res.agentId }, 'the transfer agent restarted: attaching again')
          this.#synced = false
          continue
        }
        for (const e of res.events) this.#apply(e)
        this.#after = res.last
        if (this.#outage) log.info({ agentId: this.#agentId }, 'transfer agent reachable again')
        this.#outage = false
        backoff = minMs
      } catch (err) {
        if (this.#stop.signal.aborted) break
        if (isAgentCallError(err) && err.agentCode === 'XFA_ERR_NOT_ATTACHED') this.#synced = false
        // Once per outage, not once per try.
        if (!this.#outage) log.warn({ err }, 'transfer agent unreachable; retrying')
        this.#outage = true
        await sleep(clock, backoff, this.#stop.signal).catch(() => undefined)
        backoff = Math.min(maxMs, backoff * 2)
      }
    }
  }

  #resync(): Promise<void> {
    this.#resyncing ??= this.#attach().finally(() => {
      this.#resyncing = undefined
    })
    return this.#resyncing
  }

  /**
   * Attaches, then (after the first time) leases every held block again: a restarted agent
   * lost its leases, and a decoder may still be about to read those blocks.
   */
  async #attach(): Promise<void> {
    const { log } = this.#o
    this.#gen++
    this.#after = 0
    const before = this.#agentId
    // Pulls that failed before now: if the agent restarted, their READs died with it.
    const staleTainted = [...this.#tainted.keys()]
    const body = this.#body
    const attached = await this.#client.attach(body, this.#stop.signal)
    const restarted = before !== undefined && attached.agentId !== before
    this.#agentId = attached.agentId
    this.#peer = { host: attached.peerHost, port: attached.peerPort }
    if (this.#o.leaseSeconds !== undefined && attached.leaseSeconds !== this.#o.leaseSeconds) {
      log.warn({ agent: attached.leaseSeconds, sim: this.#o.leaseSeconds }, "--lease-seconds differs from the agent's; the agent's governs")
    }
    if (restarted) {
      for (const id of staleTainted) this.#freeTainted(id)
    }
    let retry = false
    if (before !== undefined) {
      for (const [requestId, blocks] of [...this.#held]) {
        if (this.#leasing.has(requestId)) continue
        try {
          await this.#client.lease({ requestId, blockIds: [...blocks] }, this.#stop.signal)
        } catch (err) {
          if (isAgentCallError(err) && err.agentCode === 'XFA_ERR_LEASE_EXISTS') continue
          if (isAgentCallError(err) && err.agentStatus !== undefined && err.agentStatus < 500 && err.agentCode !== 'XFA_ERR_NOT_ATTACHED') {
            // Refused for good: keep the blocks pinned (never reuse what a decoder may read).
            log.error({ err, requestId }, 'the agent refused to lease held blocks again; they stay pinned')
            this.#held.delete(requestId)
            continue
          }
          retry = true
        }
      }
    }
    if (retry) throw new SIM_ERR_AGENT_NOT_READY('leasing the held blocks again failed')
    this.#attachedBody = body
    // A body changed during the call (setEngineUrl) needs one more attach.
    this.#synced = body === this.#body
    log.info({ agentId: attached.agentId, peerHost: attached.peerHost, peerPort: attached.peerPort, restarted, leases: this.#held.size }, 'attached to the transfer agent')
    this.#firstAttach.resolve()
  }

  #apply(e: AgentEvent): void {
    const { pool, metrics, log } = this.#o
    if (e.type === 'lease_ended') {
      const blocks = this.#held.get(e.requestId)
      if (!blocks) {
        log.debug({ requestId: e.requestId, reason: e.reason }, 'lease_ended for a lease this engine does not hold')
        return
      }
      this.#held.delete(e.requestId)
      pool.free(blocks)
      if (e.reason === 'expired') {
        metrics.kvExpired.inc(metrics.labels)
        log.warn({ remoteRequestId: e.requestId }, 'Releasing expired KV blocks')
      }
      return
    }
    if (this.#tainted.has(e.requestId)) this.#freeTainted(e.requestId)
    else {
      const pending = this.#pulling.get(e.requestId)
      if (pending) pending.quiesced = true
    }
  }

  #freeTainted(requestId: string): void {
    const t = this.#tainted.get(requestId)
    if (!t) return
    this.#tainted.delete(requestId)
    this.#o.pool.free(t.blocks)
  }
}
