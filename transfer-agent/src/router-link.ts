import { Agent, request, type Dispatcher } from 'undici'
import type { Clock } from '../../common/clock.js'
import type { Random } from '../../common/random.js'
import { sleep } from '../../common/timers.js'
import type { PeerGoneRequest } from '../../schemas/agent-api.js'
import type { AgentRegistration, RouterEvent } from '../../schemas/events.js'

/**
 * The agent's side of the router's event log (DESIGN "Events: router → agents"). Once the
 * engine attached: register (`POST /v1/agents`), open `GET /v1/agents/:id/events?after=N`
 * (SSE), apply each event in order, acknowledge what was applied, and start over after any
 * failure with a jittered backoff, on the next router URL when the last one could not be
 * reached.
 *
 * Invariants:
 * - `applied` only grows while the link talks to one event log. A registration answer from
 *   another log (a new `routerId`: the router restarted with its in-memory log, or another
 *   router) or one whose `lastSeq` is below `applied` restarts it from 0: that log's sequence
 *   numbers name other events, and resuming after our old number would skip its first ones.
 * - An event is acknowledged once applied: for `peer_gone` that is once the peer table marked
 *   the engine_ids failing fast (synchronous); releasing their NIXL state waits for READs in
 *   flight and is not awaited.
 * - At most one ack call is in flight; the latest applied sequence wins.
 * - Registration happens before every stream: it is idempotent for the router, tells the link
 *   which log it is talking to before it names a sequence, and makes a restarted router
 *   (which forgot every agent) know this one again without a 404 first.
 */
export interface RouterLinkTarget {
  /** Marks the engine_ids failing fast at once; the promise settles once their state is released. */
  peerGone(req: PeerGoneRequest): Promise<void>
  /** Ends a prefiller lease; false when it is not held. */
  release(requestId: string): boolean
  /** Lifts the tombstones of engine_ids the router saw answering again (optional: older targets). */
  peerAlive?(engineIds: readonly string[]): void
}

export interface RouterLinkLogger {
  debug(obj: object, msg: string): void
  info(obj: object, msg: string): void
  warn(obj: object, msg: string): void
  error(obj: object, msg: string): void
}

export interface RouterLinkMetrics {
  events: { inc(labels: { type: string }): void }
  connected: { set(value: number): void }
}

export interface RouterLinkOptions {
  /** Router base URLs, tried in order (failover on connection failure). */
  urls: readonly string[]
  agentId: string
  /** The router's agent token (Authorization: Bearer). */
  token?: string
  clock: Clock
  random: Random
  log: RouterLinkLogger
  target: RouterLinkTarget
  metrics?: RouterLinkMetrics
  backoffMinMs?: number
  backoffMaxMs?: number
  /**
   * A stream silent this long is treated as dead, and the next router followed. Default: three
   * of the router's keep-alive intervals, as its registration answer gives them (at least 3 s),
   * or 60 s from a router that does not say.
   */
  idleTimeoutMs?: number
  /** Timeout of registration and ack calls, ms. */
  callTimeoutMs?: number
}

/** What the router is told about this agent (AgentRegistration less the agentId). */
export type LinkRegistration = Omit<AgentRegistration, 'agentId'>

export interface RouterLinkStatus {
  url: string
  urls: string[]
  connected: boolean
  routerId: string | null
  lastApplied: number
  lastAcked: number
  engineId: string | null
}

/** A router answer other than the one expected. */
class RouterAnswerError extends Error {
  constructor(
    readonly status: number,
    readonly code: string | undefined,
    message: string,
  ) {
    super(message)
  }
}

const REATTACH = Symbol('re-attach')

export class RouterLink {
  readonly #o: RouterLinkOptions
  readonly #urls: string[]
  readonly #dispatcher: Dispatcher
  readonly #stop = new AbortController()
  #index = 0
  #reg: LinkRegistration | undefined
  #attempt: AbortController | undefined
  #loop: Promise<void> | undefined
  #connected = false
  #outage = false
  #routerId: string | undefined
  /** The keep-alive interval of the router registered with last (its answer), if it said. */
  #keepAliveMs: number | undefined
  #applied = 0
  #acked = 0
  #acking: Promise<void> | undefined

  constructor(opts: RouterLinkOptions) {
    const urls = opts.urls.map((u) => u.replace(/\/+$/, ''))
    if (urls.length === 0) throw new RangeError('RouterLink needs at least one router URL')
    for (const u of urls) if (!/^https?:\/\/[^/]/.test(u)) throw new RangeError(`not a router URL: ${u}`)
    this.#o = opts
    this.#urls = urls
    const callTimeoutMs = opts.callTimeoutMs ?? 5000
    this.#dispatcher = new Agent({ connections: 4, connect: { timeout: callTimeoutMs }, keepAliveTimeout: 10_000, headersTimeout: callTimeoutMs, bodyTimeout: callTimeoutMs })
  }

  /**
   * The engine attached (again): starts the link, or, when what the router knows changed
   * (another engine_id after an engine restart, a new engine URL), registers again at once.
   */
  attached(reg: LinkRegistration): void {
    if (this.#stop.signal.aborted) return
    const old = this.#reg
    this.#reg = { ...reg }
    if (!this.#loop) {
      this.#loop = this.#run()
      return
    }
    if (old && (old.engineId !== reg.engineId || old.engineUrl !== reg.engineUrl || old.agentUrl !== reg.agentUrl || old.role !== reg.role)) {
      this.#attempt?.abort(REATTACH)
    }
  }

  status(): RouterLinkStatus {
    return {
      url: this.#urls[this.#index] as string,
      urls: [...this.#urls],
      connected: this.#connected,
      routerId: this.#routerId ?? null,
      lastApplied: this.#applied,
      lastAcked: this.#acked,
      engineId: this.#reg?.engineId ?? null,
    }
  }

  async close(): Promise<void> {
    this.#stop.abort()
    await this.#loop
    await this.#acking
    this.#setConnected(false)
    await this.#dispatcher.destroy()
  }

  async #run(): Promise<void> {
    const { clock, random, log } = this.#o
    const minMs = this.#o.backoffMinMs ?? 100
    const maxMs = this.#o.backoffMaxMs ?? 2000
    let backoff = minMs
    while (!this.#stop.signal.aborted) {
      const url = this.#urls[this.#index] as string
      const attempt = new AbortController()
      this.#attempt = attempt
      const signal = AbortSignal.any([this.#stop.signal, attempt.signal])
      let failure: unknown
      let ended = false
      try {
        await this.#register(url, signal)
        await this.#stream(url, signal, () => {
          backoff = minMs
          if (this.#outage) log.info({ url, routerId: this.#routerId, after: this.#applied }, 'router event stream back')
          else log.info({ url, routerId: this.#routerId, after: this.#applied }, 'router event stream open')
          this.#outage = false
        })
        ended = true
      } catch (err) {
        failure = err
      }
      this.#setConnected(false)
      if (this.#stop.signal.aborted) break
      if (attempt.signal.reason === REATTACH) continue
      const unknown = failure instanceof RouterAnswerError && failure.code === 'RTR_ERR_AGENT_UNKNOWN'
      // Unreachable, refusing or failing: the next router, if there is one. A router that
      // forgot this agent (404) or ended the stream cleanly is tried again first.
      if (!unknown && !ended) this.#index = (this.#index + 1) % this.#urls.length
      if (!this.#outage) {
        // Once per outage, not once per try.
        log.warn({ url, err: ended ? 'the router ended the stream' : describe(failure), next: this.#urls[this.#index] }, 'router event stream lost; retrying')
        this.#outage = true
      }
      // Equal jitter: half the backoff fixed, half random, so agents do not reconnect in step.
      const wait = backoff / 2 + random.next() * (backoff / 2)
      backoff = Math.min(maxMs, backoff * 2)
      await sleep(clock, wait, this.#stop.signal).catch(() => undefined)
    }
  }

  async #register(url: string, signal: AbortSignal): Promise<void> {
    const reg = this.#reg as LinkRegistration
    const body: AgentRegistration = { agentId: this.#o.agentId, ...reg }
    const res = await this.#call(url, '/v1/agents', body, signal)
    const answer = res as { routerId?: unknown; lastSeq?: unknown; keepAliveMs?: unknown }
    this.#keepAliveMs = typeof answer.keepAliveMs === 'number' && answer.keepAliveMs > 0 ? answer.keepAliveMs : undefined
    const lastSeq = typeof answer.lastSeq === 'number' ? answer.lastSeq : 0
    const routerId = typeof answer.routerId === 'string' ? answer.routerId : undefined
    const otherLog = (this.#routerId !== undefined && routerId !== undefined && routerId !== this.#routerId) || lastSeq < this.#applied
    if (otherLog) {
      this.#o.log.warn(
        { url, was: this.#routerId ?? null, now: routerId ?? null, lastApplied: this.#applied, lastSeq },
        "another event log (the router restarted, or another router): applying it from its start",
      )
      this.#applied = 0
      this.#acked = 0
    }
    if (routerId !== undefined) this.#routerId = routerId
  }

  /** One stream: resolves when the router ends it, rejects on any failure. */
  async #stream(url: string, signal: AbortSignal, onOpen: () => void): Promise<void> {
    const res = await request(`${url}/v1/agents/${encodeURIComponent(this.#o.agentId)}/events?after=${this.#applied}`, {
      dispatcher: this.#dispatcher,
      signal,
      headers: { accept: 'text/event-stream', ...this.#auth() },
      bodyTimeout: this.#o.idleTimeoutMs ?? (this.#keepAliveMs ? Math.max(3000, 3 * this.#keepAliveMs) : 60_000),
    })
    if (res.statusCode !== 200) throw await answerError(res)
    this.#setConnected(true)
    onOpen()
    // Acks that failed while disconnected go now.
    this.#ack()
    const decoder = new TextDecoder()
    let buffer = ''
    for await (const chunk of res.body) {
      buffer += decoder.decode(chunk as Buffer, { stream: true })
      let end: number
      while ((end = buffer.indexOf('\n\n')) >= 0) {
        const frame = buffer.slice(0, end)
        buffer = buffer.slice(end + 2)
        const event = parseFrame(frame)
        if (event) this.#apply(event)
      }
    }
  }

  #apply(event: RouterEvent): void {
    const { log, target, metrics } = this.#o
    // A repeat after a resume overlap; a snapshot always stands for what came before it.
    if (event.type !== 'snapshot' && event.seq <= this.#applied) return
    try {
      if (event.type === 'peer_gone') {
        // The router resolved its addresses into engineIds when it logged the event; an
        // address applied later could name a newer engine at the same host:port (a restart
        // between logging and delivery) and fail a live peer. Engine_ids only, then.
        if (event.engineIds.length > 0) this.#peerGone(event.engineIds, event.reason)
      } else if (event.type === 'peer_alive') {
        target.peerAlive?.(event.engineIds)
        log.info({ seq: event.seq, engineIds: event.engineIds, reason: event.reason }, 'peer_alive applied: tombstones lifted')
      } else if (event.type === 'lease_release') {
        if (event.prefillEngineId === this.#reg?.engineId) {
          let released = 0
          for (const id of event.requestIds) if (target.release(id)) released++
          log.info({ seq: event.seq, requestIds: event.requestIds.length, released, reason: event.reason }, 'lease_release applied')
        }
      } else if (event.type === 'snapshot') {
        if (event.goneEngineIds.length > 0) this.#peerGone(event.goneEngineIds, 'snapshot')
      } else {
        log.debug({ event }, 'router event of an unknown type: skipped')
      }
    } catch (err) {
      // Not attached any more (the engine is re-attaching): nothing of it is held here.
      log.warn({ err, seq: event.seq, type: event.type }, 'applying a router event failed')
    }
    this.#applied = Math.max(this.#applied, event.seq)
    metrics?.events.inc({ type: event.type })
    this.#ack()
  }

  #peerGone(engineIds: string[], reason: string): void {
    // The peer table marks them failing fast before this call returns; the promise is the release.
    this.#o.target.peerGone({ engineIds, reason: reason.slice(0, 256) }).catch((err: unknown) => {
      this.#o.log.warn({ err, engineIds }, 'releasing a gone peer failed')
    })
  }

  #ack(): void {
    if (this.#acking || this.#applied <= this.#acked || !this.#connected) return
    this.#acking = this.#sendAcks().finally(() => {
      this.#acking = undefined
    })
  }

  async #sendAcks(): Promise<void> {
    while (this.#connected && this.#applied > this.#acked && !this.#stop.signal.aborted) {
      const seq = this.#applied
      const routerId = this.#routerId
      const url = this.#urls[this.#index] as string
      try {
        await this.#call(url, `/v1/agents/${encodeURIComponent(this.#o.agentId)}/acks`, { seq }, this.#stop.signal)
      } catch (err) {
        // Sent again with the next event or the next connection.
        if (err instanceof RouterAnswerError && err.code === 'RTR_ERR_AGENT_UNKNOWN') this.#attempt?.abort(new Error('the router forgot this agent'))
        this.#o.log.debug({ err: describe(err), seq }, 'ack failed')
        return
      }
      if (routerId === this.#routerId) this.#acked = Math.max(this.#acked, seq)
    }
  }

  async #call(url: string, path: string, body: unknown, signal: AbortSignal): Promise<unknown> {
    const res = await request(`${url}${path}`, {
      dispatcher: this.#dispatcher,
      method: 'POST',
      signal,
      headers: { 'content-type': 'application/json', ...this.#auth() },
      body: JSON.stringify(body),
    })
    if (res.statusCode >= 300) throw await answerError(res)
    const text = await res.body.text()
    return text ? (JSON.parse(text) as unknown) : undefined
  }

  #auth(): Record<string, string> {
    return this.#o.token ? { authorization: `Bearer ${this.#o.token}` } : {}
  }

  #setConnected(value: boolean): void {
    this.#connected = value
    this.#o.metrics?.connected.set(value ? 1 : 0)
  }
}

/** One SSE frame → its event (JSON `data:`), or undefined for a comment or a bad frame. */
export function parseFrame(frame: string): RouterEvent | undefined {
  const data: string[] = []
  for (const raw of frame.split('\n')) {
    const line = raw.endsWith('\r') ? raw.slice(0, -1) : raw
    if (line.startsWith('data:')) data.push(line.slice(line[5] === ' ' ? 6 : 5))
  }
  if (data.length === 0) return undefined
  try {
    const event = JSON.parse(data.join('\n')) as RouterEvent
    if (typeof event !== 'object' || event === null || !Number.isInteger(event.seq) || typeof event.type !== 'string') return undefined
    return event
  } catch {
    return undefined
  }
}

async function answerError(res: Dispatcher.ResponseData): Promise<RouterAnswerError> {
  const text = await res.body.text().catch(() => '')
  let code: string | undefined
  try {
    code = (JSON.parse(text) as { error?: { code?: string } }).error?.code
  } catch {
    // Not JSON: the status says enough.
  }
  return new RouterAnswerError(res.statusCode, code, `router answered ${res.statusCode}${code ? ` ${code}` : ''}: ${text.slice(0, 200)}`)
}

function describe(err: unknown): string {
  if (err instanceof Error) return `${(err as { code?: string }).code ?? err.name}: ${err.message}`
  return String(err)
}
