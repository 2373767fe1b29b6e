import type { Clock, ClockTimer } from '../../common/clock.js'
import type { AgentEvent } from '../../schemas/agent-api.js'

/** An event before it gets its sequence number. */
export type AgentEventInput = AgentEvent extends infer E ? (E extends { seq: number } ? Omit<E, 'seq'> : never) : never

/**
 * What the agent tells its engine, in order: leases that ended (the prefiller frees those
 * blocks now) and failed pulls whose destination blocks no READ can still write (the decoder
 * may reuse them). The engine long-polls `after` the last sequence it handled; everything up
 * to that is dropped, so an answer lost on the way is simply sent again. Nothing is dropped
 * unread: an engine that stops polling keeps its events queued (bounded by its own blocks,
 * since each event frees blocks the engine holds).
 */
export class EngineEvents {
  readonly #clock: Clock
  #queue: AgentEvent[] = []
  #seq = 0
  readonly #waiters = new Set<() => void>()

  constructor(opts: { clock: Clock }) {
    this.#clock = opts.clock
  }

  get pending(): number {
    return this.#queue.length
  }

  get last(): number {
    return this.#seq
  }

  push(event: AgentEventInput): number {
    const seq = ++this.#seq
    this.#queue.push({ ...event, seq } as AgentEvent)
    for (const wake of [...this.#waiters]) wake()
    return seq
  }

  /**
   * Events after `after` (dropping those up to it), waiting up to `waitMs` for one when there
   * are none. Resolves early with none when `signal` aborts (the engine went away).
   */
  async poll(after: number, waitMs: number, signal?: AbortSignal): Promise<AgentEvent[]> {
    this.#ack(after)
    if (this.#queue.length > 0 || waitMs <= 0 || signal?.aborted) return this.#after(after)
    await new Promise<void>((resolve) => {
      let timer: ClockTimer | undefined
      const done = (): void => {
        this.#waiters.delete(done)
        if (timer) this.#clock.clearTimeout(timer)
        signal?.removeEventListener('abort', done)
        resolve()
      }
      this.#waiters.add(done)
      timer = this.#clock.setTimeout(done, waitMs)
      signal?.addEventListener('abort', done, { once: true })
    })
    return this.#after(after)
  }

  #ack(after: number): void {
    let i = 0
    while (i < this.#queue.length && (this.#queue[i] as AgentEvent).seq <= after) i++
    if (i > 0) this.#queue = this.#queue.slice(i)
  }

  #after(after: number): AgentEvent[] {
    return this.#queue.filter((e) => e.seq > after)
  }
}
