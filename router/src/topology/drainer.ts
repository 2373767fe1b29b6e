import type { Clock, ClockTimer } from '../../../common/clock.js'
import { RTR_ERR_INSTANCE_NOT_FOUND } from '../errors.js'
import type { PeerGoneResult, PeerGoneTarget } from '../events/router-events.js'
import type { LeaseLedger } from '../leases/ledger.js'
import type { TopologyRegistry } from './registry.js'

/** Where a drain stands: what still holds the instance. */
export interface DrainStatus {
  id: string
  /** Nothing was left: peer_gone went out and the instance left the topology. */
  drained: boolean
  /** The instance is no longer in the topology (drained, or deleted while draining). */
  removed: boolean
  inflight: number
  unreadLeases: number
  /**
   * Other routers sharing the store that have not yet said what they have in flight there
   * (they have not heard of the drain yet); present only when some have not. Not drained
   * until each has.
   */
  unheardRouters?: number
}

/** Requests in flight at an instance on the other routers, and how many of those have not said. */
export interface RemoteInflight {
  inflight: number
  unheard: number
}

export interface RemoveResult {
  id: string
  /** The peer_gone event's sequence; null when no engine_id was known for the instance. */
  peerGoneSeq: number | null
  engineIds: string[]
}

export interface DrainerOptions {
  registry: TopologyRegistry
  ledger: LeaseLedger
  events: {
    /** Awaited: with a shared event store it writes to Redis. */
    peerGone(target: PeerGoneTarget, reason: string): PeerGoneResult | Promise<PeerGoneResult>
  }
  clock: Clock
  logger: { info(obj: object, msg: string): void; warn?(obj: object, msg: string): void }
  /** How often a pending drain is looked at again (leases also end by time). Default 250 ms. */
  pollMs?: number
  /** Requests in flight at the instance on the other routers sharing the store (default none). */
  remoteInflight?: (id: string) => Promise<RemoteInflight>
}

export interface DrainOptions {
  /**
   * Whether the engine is going away (a preStop hook, a pod terminating): then its
   * engine_ids get `peer_gone` once it is drained. False for an instance only taken out of
   * routing (a pod NotReady for a while): its engine may well come back under the same
   * engine_id, and agents that tombstoned it would refuse its blocks for minutes. Default true.
   */
  peerGone?: boolean
}

interface Pending {
  waiters: Set<(status: DrainStatus | Promise<DrainStatus>) => void>
  /** peer_gone once drained: asked by any drain call of it (DrainOptions.peerGone). */
  peerGone: boolean
  /** Set when nothing was left and the instance was retired (not deleted by hand). */
  drained: boolean
  /** The last word, once it left the topology. */
  final?: DrainStatus
  /** The check under way (one at a time), and whether another was asked for meanwhile. */
  checking?: Promise<void>
  again?: boolean
}

/**
 * Retiring instances (DESIGN "Events", autoscaler hooks). A draining instance admits nothing
 * new (the registry's `draining`); it is drained once it has no request in flight and, as a
 * prefiller, no unread lease in the ledger: P's slot goes back as soon as P answered, while D
 * may still be about to read P's blocks. Then it leaves the topology, with `peer_gone` for its
 * engine_ids when its engine is going away (DrainOptions: out of routing is not gone). A decoder that goes down or leaves keeps its leases: out of routing is not
 * gone, and D may still be reading (ledger.ts, "who may end a lease early"). The unread count is the ledger's
 * (every router's, with a shared one) and async: a check that cannot get it (Redis
 * unreachable) decides nothing and is tried again at the next poll.
 */
export class Drainer {
  readonly #o: DrainerOptions
  readonly #pending = new Map<string, Pending>()
  readonly #unsubscribe: (() => void)[]
  #timer: ClockTimer | undefined

  constructor(opts: DrainerOptions) {
    this.#o = opts
    this.#unsubscribe = [
      opts.registry.subscribe((change) => {
        if (change.type === 'removed') this.#settle(change.instanceId)
        else if ((change.type === 'released' || change.type === 'drained') && this.#pending.has(change.instanceId)) this.#later(change.instanceId)
      }),
      opts.ledger.onEnded((lease) => {
        if (this.#pending.has(lease.prefill)) this.#later(lease.prefill)
      }),
    ]
  }

  /**
   * Starts (or continues) draining `id`; answers where it stands now. The drain has begun
   * even when the answer fails (the ledger could not count): asking again joins it.
   */
  async drain(id: string, opts: DrainOptions = {}): Promise<DrainStatus> {
    const { registry } = this.#o
    if (!registry.has(id)) throw new RTR_ERR_INSTANCE_NOT_FOUND(id)
    const peerGone = opts.peerGone ?? true
    let pending = this.#pending.get(id)
    if (!pending) {
      pending = { waiters: new Set(), drained: false, peerGone }
      this.#pending.set(id, pending)
      registry.drain(id)
      this.#o.logger.info({ instance: id, peerGone }, 'draining')
      this.#poll()
    } else if (peerGone && !pending.peerGone) {
      pending.peerGone = true
      this.#o.logger.info({ instance: id }, 'draining: its engine is going away')
    }
    await this.#check(id)
    return pending.final ?? this.status(id)
  }

  /**
   * Resolves when `id` is drained (or removed), or after `timeoutMs` with what was left;
   * rejects when what was left cannot be counted then.
   */
  wait(id: string, timeoutMs: number, signal?: AbortSignal): Promise<DrainStatus> {
    const pending = this.#pending.get(id)
    if (!pending) return this.status(id)
    return new Promise((resolve) => {
      const done = (status: DrainStatus | Promise<DrainStatus>): void => {
        this.#o.clock.clearTimeout(timer)
        signal?.removeEventListener('abort', onAbort)
        pending.waiters.delete(done)
        resolve(status)
      }
      const onAbort = (): void => done(this.status(id))
      const timer = this.#o.clock.setTimeout(() => done(this.status(id)), timeoutMs)
      signal?.addEventListener('abort', onAbort, { once: true })
      pending.waiters.add(done)
    })
  }

  /**
   * What still holds `id`. The order of the reads is what makes "drained" true: a prefill
   * leg records its lease before its slot goes back (handoff.ts), and a draining instance
   * admits nothing new. So what is in flight is read first, here and then on the other
   * routers (each publishes its count only once its leases are in Redis), and the unread
   * leases after: a leg that ends between two reads is counted in one or the other. Read the
   * other way round, a leg ending meanwhile was in neither, and peer_gone went out while D
   * was still to read its blocks (issue 20, fr20).
   */
  async status(id: string): Promise<DrainStatus> {
    const here = this.#o.registry.load(id)
    if (!here) return removedStatus(id)
    const inflight = here.inflight
    const remote = (await this.#o.remoteInflight?.(id)) ?? { inflight: 0, unheard: 0 }
    const unreadLeases = await this.#o.ledger.unreadBy(id)
    // It may have left the topology while the store answered.
    if (!this.#o.registry.has(id)) return removedStatus(id)
    return { id, drained: false, removed: false, inflight: inflight + remote.inflight, unreadLeases, ...(remote.unheard > 0 ? { unheardRouters: remote.unheard } : {}) }
  }

  /** Deregisters `id` now (DELETE /admin/instances/:id): peer_gone for its engine_ids, then gone. */
  async remove(id: string, reason: string): Promise<RemoveResult> {
    if (!this.#o.registry.has(id)) throw new RTR_ERR_INSTANCE_NOT_FOUND(id)
    return this.#retire(id, reason)
  }

  close(): void {
    for (const u of this.#unsubscribe) u()
    if (this.#timer) this.#o.clock.clearTimeout(this.#timer)
    this.#timer = undefined
    for (const id of [...this.#pending.keys()]) this.#settle(id)
  }

  // A registry change arrives while the registry is still telling its other subscribers:
  // look again once that is over, so they never hear of a removal in the middle of it.
  #later(id: string): void {
    queueMicrotask(() => void this.#check(id))
  }

  /** Retires `id` if nothing holds it; one check at a time, and one more if asked meanwhile. Never rejects. */
  #check(id: string): Promise<void> {
    const pending = this.#pending.get(id)
    if (!pending) return Promise.resolve()
    if (pending.checking) {
      pending.again = true
      return pending.checking
    }
    const run = async (): Promise<void> => {
      do {
        pending.again = false
        const s = await this.status(id)
        if (this.#pending.get(id) !== pending) return
        if (s.removed || s.inflight > 0 || s.unreadLeases > 0 || (s.unheardRouters ?? 0) > 0) continue
        this.#o.logger.info({ instance: id }, 'drained')
        pending.drained = true
        try {
          await this.#retire(id, `drained: instance ${id}`, pending.peerGone)
        } catch (err) {
          pending.drained = false
          throw err
        }
        return
      } while (pending.again)
    }
    pending.checking = run()
      .catch((err: unknown) => this.#o.logger.warn?.({ instance: id, err }, 'drain check failed; trying again at the next poll'))
      .finally(() => {
        pending.checking = undefined
      })
    return pending.checking
  }

  async #retire(id: string, reason: string, peerGone = true): Promise<RemoveResult> {
    const view = this.#o.registry.snapshot().instances.find((i) => i.id === id)
    // Its engines' own engine_ids (every rank behind its URL), learned from their answers:
    // never an agent's claim (an agent registration is not the engine's word, issue 18 item 2),
    // and never by URL alone (with IP reuse another pod's engine may serve that URL now). A
    // prefiller that never answered has no engine_id, and then no decoder holds any state of it.
    const engineIds = new Set(view?.engineIds)
    if (!peerGone) {
      this.#o.logger.info({ instance: id, engineIds: [...engineIds] }, 'out of routing: removed without peer_gone (its engine may come back)')
      this.#o.registry.remove(id)
      return { id, peerGoneSeq: null, engineIds: [] }
    }
    // peer_gone before removal: the instance's engine_id must still be known to the events.
    const gone = engineIds.size > 0 ? await this.#o.events.peerGone({ engineIds: [...engineIds] }, reason) : undefined
    this.#o.registry.remove(id)
    return { id, peerGoneSeq: gone?.seq ?? null, engineIds: [...engineIds] }
  }

  /** The instance left the topology: whoever waits on its drain gets the last word. */
  #settle(id: string): void {
    const pending = this.#pending.get(id)
    if (!pending) return
    this.#pending.delete(id)
    if (this.#pending.size === 0 && this.#timer) {
      this.#o.clock.clearTimeout(this.#timer)
      this.#timer = undefined
    }
    if (this.#o.registry.has(id)) {
      // Closing with the drain unfinished: where it stands, once the ledger says.
      const last = this.status(id)
      last.catch(() => {})
      for (const w of [...pending.waiters]) w(last)
      return
    }
    pending.final = { ...removedStatus(id), drained: pending.drained }
    for (const w of [...pending.waiters]) w(pending.final)
  }

  #poll(): void {
    if (this.#timer || this.#pending.size === 0) return
    this.#timer = this.#o.clock.setTimeout(() => {
      this.#timer = undefined
      for (const id of [...this.#pending.keys()]) void this.#check(id)
      this.#poll()
    }, this.#o.pollMs ?? 250)
    this.#timer.unref?.()
  }
}

function removedStatus(id: string): DrainStatus {
  return { id, drained: false, removed: true, inflight: 0, unreadLeases: 0 }
}
