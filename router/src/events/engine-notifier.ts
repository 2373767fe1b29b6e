import { Agent, request } from 'undici'
import type { Clock } from '../../../common/clock.js'
import { sleep } from '../../../common/timers.js'
import type { TopologyRegistry } from '../topology/registry.js'
import type { AgentDirectory } from './agent-directory.js'
import type { LoggedEvent } from './event-log.js'
import type { EventsLogger } from './router-events.js'

/**
 * Engine mode (DESIGN "Two transfer modes"): engines that move KV themselves (stock vLLM with
 * its NIXL connector) have no agent to read the event stream, so on every `peer_gone` the
 * router calls each of them itself: `POST <urlTemplate>` with `{"engine_id": …}`, the shape of
 * vLLM's proposed `/drop_peer` (PR #56341), with retries. Engines with a registered agent are
 * skipped (their agent applies the event). Without a template nothing is called and each
 * skipped notification is counted as `not_configured`, so an operator can see what was not
 * cleaned up. The URL is built from instances in the topology only: never another address.
 */
export interface EngineNotifierOptions {
  registry: TopologyRegistry
  agents: AgentDirectory
  clock: Clock
  logger: EventsLogger
  /** `{instance_url}` and `{engine_id}` are replaced (the latter URL-encoded); undefined: off. */
  urlTemplate: string | undefined
  retries: number
  timeoutMs: number
  backoffMs: number
  /** Adds a bearer token to every call (engines started with --api-key). */
  apiKey?: string
  metrics: { inc(labels: { outcome: 'ok' | 'failed' | 'not_configured' }): void }
}

export class EngineNotifier {
  readonly #o: EngineNotifierOptions
  readonly #dispatcher: Agent
  readonly #pending = new Set<Promise<void>>()
  #closed = false
  #warned = false

  constructor(opts: EngineNotifierOptions) {
    this.#o = opts
    this.#dispatcher = new Agent({ connections: 4, connect: { timeout: opts.timeoutMs } })
  }

  /** Waits for notifications in flight (tests; shutdown). */
  async settled(): Promise<void> {
    while (this.#pending.size > 0) await Promise.all([...this.#pending])
  }

  async close(): Promise<void> {
    this.#closed = true
    await this.settled()
    await this.#dispatcher.close()
  }

  /**
   * An event this router logged. Only the router that logged a peer_gone tells the engines
   * (several routers share one log; each would otherwise call every engine once).
   */
  notify(event: LoggedEvent): void {
    if (event.type !== 'peer_gone' || this.#closed) return
    const withAgents = new Set(this.#o.agents.all().map((a) => a.instanceId))
    const targets = this.#o.registry
      .snapshot()
      .instances.filter((i) => !withAgents.has(i.id) && !i.engineIds.some((e) => event.engineIds.includes(e)))
    for (const instance of targets) {
      for (const engineId of event.engineIds) {
        if (!this.#o.urlTemplate) {
          this.#o.metrics.inc({ outcome: 'not_configured' })
          if (!this.#warned) {
            this.#warned = true
            this.#o.logger.warn({ seq: event.seq }, 'peer_gone: engines without an agent were not told (no engine-mode URL template configured)')
          }
          continue
        }
        const url = this.#o.urlTemplate.replace('{instance_url}', instance.url.replace(/\/+$/, '')).replace('{engine_id}', encodeURIComponent(engineId))
        const p = this.#notify(url, engineId, instance.id, event.seq).finally(() => this.#pending.delete(p))
        this.#pending.add(p)
      }
    }
  }

  async #notify(url: string, engineId: string, instance: string, seq: number): Promise<void> {
    const o = this.#o
    let lastError = ''
    for (let attempt = 0; attempt <= o.retries && !this.#closed; attempt++) {
      if (attempt > 0) await sleep(o.clock, o.backoffMs * 2 ** (attempt - 1))
      try {
        const res = await request(url, {
          method: 'POST',
          dispatcher: this.#dispatcher,
          headers: { 'content-type': 'application/json', ...(o.apiKey ? { authorization: `Bearer ${o.apiKey}` } : {}) },
          body: JSON.stringify({ engine_id: engineId }),
          headersTimeout: o.timeoutMs,
          bodyTimeout: o.timeoutMs,
        })
        await res.body.dump()
        if (res.statusCode < 300) {
          o.metrics.inc({ outcome: 'ok' })
          return
        }
        lastError = `HTTP ${res.statusCode}`
        // A 4xx will not change on a retry (no such endpoint, bad request).
        if (res.statusCode < 500) break
      } catch (err) {
        lastError = (err as Error).message
      }
    }
    o.metrics.inc({ outcome: 'failed' })
    o.logger.warn({ seq, instance, engineId, url, error: lastError }, 'peer_gone: could not tell an engine')
  }
}
