import type { FastifyBaseLogger } from 'fastify'
import type { Clock, ClockTimer } from '../../../common/clock.js'
import type { TopologyRegistry } from './registry.js'

/** A GET that resolves with the status and text, or rejects on transport failure/timeout. */
export type HttpGet = (url: string, timeoutMs: number) => Promise<{ status: number; text: string }>

export interface ProberOptions {
  registry: TopologyRegistry
  get: HttpGet
  clock: Clock
  log: FastifyBaseLogger
  intervalMs: number
  timeoutMs: number
}

/** ECONNREFUSED on the error or its cause chain (undici wraps socket errors). */
function connectionRefused(err: unknown): boolean {
  for (let e = err as { code?: unknown; cause?: unknown } | undefined, depth = 0; e && depth < 4; e = e.cause as typeof e, depth++) {
    if (e.code === 'ECONNREFUSED') return true
  }
  return false
}

/** An engine's model card as its /v1/models lists it (vLLM adds root, parent, max_model_len, permission). */
export type ModelCard = { id: string } & Record<string, unknown>

function parseModels(text: string): ModelCard[] | undefined {
  try {
    const body = JSON.parse(text) as { data?: unknown }
    if (!Array.isArray(body.data)) return undefined
    return body.data.filter((m): m is ModelCard => typeof m === 'object' && m !== null && typeof (m as { id?: unknown }).id === 'string')
  } catch {
    return undefined
  }
}

/**
 * Active health checks: `GET /health` on every instance each interval, and `GET /v1/models`
 * until the instance's models are known. Results go to the registry, which also receives
 * passive request outcomes and tells its subscribers what changed. The `get` it is given runs
 * on connections of its own: a probe queued behind hundreds of streams would time out and
 * report a busy engine as dead.
 */
export class Prober {
  readonly #o: ProberOptions
  /** The last card an engine gave for each model, for the router's own /v1/models. */
  readonly #cards = new Map<string, ModelCard>()
  #timer: ClockTimer | undefined
  #stopped = false

  constructor(opts: ProberOptions) {
    if (opts.intervalMs <= 0 || opts.timeoutMs <= 0) throw new RangeError('probe interval and timeout must be positive')
    this.#o = opts
  }

  /** The card an engine gave for `model`, if this router read one (a replica that never led the probes has none). */
  card(model: string): ModelCard | undefined {
    return this.#cards.get(model)
  }

  /** Probes every instance once; resolves when all answered or timed out. */
  async probeAll(): Promise<void> {
    await Promise.all(this.#o.registry.ids().map((id) => this.probe(id)))
  }

  start(): void {
    this.#stopped = false
    const tick = (): void => {
      this.#timer = undefined
      void this.probeAll().finally(() => {
        if (!this.#stopped) this.#schedule(tick)
      })
    }
    this.#schedule(tick)
  }

  stop(): void {
    this.#stopped = true
    if (this.#timer) this.#o.clock.clearTimeout(this.#timer)
    this.#timer = undefined
  }

  #schedule(fn: () => void): void {
    const t = this.#o.clock.setTimeout(fn, this.#o.intervalMs)
    t.unref?.()
    this.#timer = t
  }

  /** Probes one instance now (one that just joined, so it is known before it gets work). */
  async probe(id: string): Promise<void> {
    const { registry, get, timeoutMs, log } = this.#o
    const base = registry.url(id)
    let up = false
    let refused = false
    let models: string[] | undefined
    // A probe that gets no answer says nothing while the engine answers requests (registry.ts, HealthPolicy).
    const answersBefore = registry.answers(id)
    let unanswered: number | undefined
    try {
      const health = await get(`${base}/health`, timeoutMs)
      up = health.status === 200
      if (up && registry.needsModels(id)) {
        const res = await get(`${base}/v1/models`, timeoutMs)
        const cards = res.status === 200 ? parseModels(res.text) : undefined
        for (const c of cards ?? []) this.#cards.set(c.id, c)
        models = cards?.map((c) => c.id)
      }
    } catch (err) {
      // Nothing listens there: unlike a timeout (a frozen or busy engine), the process is gone.
      refused = connectionRefused(err)
      if (!refused) unanswered = answersBefore
      log.debug({ instance: id, err, refused }, 'health probe failed')
    }
    registry.recordProbe(id, up, models, refused, unanswered)
  }
}
