import type { Clock } from '../../common/clock.js'
import { every, type Every } from '../../common/timers.js'
import type { HeartbeatRegistry } from './heartbeats.js'

/**
 * Sends `HB:<id>,<id>` (P-side request ids) to every prefiller this agent is about to read
 * from, every `intervalMs` (vLLM: kv_lease_duration / 6), and records each send in the
 * registry, which the deadline check reads. A send is recorded at the time it started; one
 * that failed, or that took longer than `maxSendMs` (the process was paused, the lock was
 * held), counts as failed, because the margin only covers a short delivery delay.
 */
export interface HeartbeatSenderOptions {
  clock: Clock
  heartbeats: HeartbeatRegistry
  intervalMs: number
  maxSendMs: number
  /** Whether a handshake with the engine is loaded (no send is attempted before). */
  canSend: (engineId: string) => boolean
  send: (engineId: string, message: string) => Promise<void>
  onSent?: (engineId: string, ids: number, ok: boolean) => void
}

export class HeartbeatSender {
  readonly #o: HeartbeatSenderOptions
  #timer: Every | undefined

  constructor(opts: HeartbeatSenderOptions) {
    if (!(opts.intervalMs > 0)) throw new RangeError(`heartbeat interval must be positive, got ${opts.intervalMs}`)
    this.#o = opts
  }

  start(): void {
    this.#timer ??= every(this.#o.clock, this.#o.intervalMs, () => this.tick(), { onError: () => undefined })
  }

  stop(): void {
    this.#timer?.stop()
    this.#timer = undefined
  }

  /** One round: one message per prefiller with tracked pulls. */
  async tick(): Promise<void> {
    await Promise.all(this.#o.heartbeats.engines().map((engineId) => this.sendTo(engineId)))
  }

  /**
   * One message to `engineId` now, off the round's schedule: the first heartbeat of a request
   * should leave as soon as a handshake can carry it, since the extension bound shrinks with
   * every ms it waits (deadline.ts). Sending more often only shortens gaps.
   */
  async sendTo(engineId: string): Promise<void> {
    const o = this.#o
    if (!o.canSend(engineId)) return
    const ids = o.heartbeats.requestIds(engineId)
    if (ids.length === 0) return
    const at = o.clock.monotonic()
    let ok = true
    try {
      await o.send(engineId, `HB:${ids.join(',')}`)
    } catch {
      ok = false
    }
    if (o.clock.monotonic() - at > o.maxSendMs) ok = false
    for (const id of ids) o.heartbeats.sent(engineId, id, ok, at)
    o.onSent?.(engineId, ids.length, ok)
  }
}
