import type { ServerResponse } from 'node:http'
import type { FastifyPluginAsync } from 'fastify'
import type { AgentAck, AgentRegistration, RouterEvent, SnapshotEvent } from '../../../schemas/events.js'
import { RTR_ERR_AGENT_UNAUTHORIZED, RTR_ERR_AGENT_UNKNOWN } from '../errors.js'
import type { RouterEvents } from '../events/router-events.js'
import { bearerChecker } from '../../../common/bearer.js'

/**
 * The agents' side of the event log (DESIGN "Events"):
 * - `POST /v1/agents`: registration once the agent's engine attached;
 * - `GET /v1/agents/:agentId/events?after=N` (or `Last-Event-ID`): an SSE stream of every
 *   event after N, a snapshot first when N fell out of retention, then live ones; a comment
 *   line every `keepAliveMs` keeps proxies from closing an idle stream;
 * - `POST /v1/agents/:agentId/acks {seq}`: everything up to seq was applied (delivery).
 * With an agent token configured, every call must carry it.
 *
 * A stream's memory is bounded (issue 18 item 3): events are written while the socket holds
 * at most `streamBufferBytes` unsent. Past that the stream holds no queue, only its place in
 * the log: once the socket drains it reads on from there, a page at a time (a replay of the
 * whole log is paced by the reader; one that fell behind retention gets a snapshot, as a
 * reconnecting agent would). A stream that took nothing for a whole keep-alive interval with
 * its buffer full is cut; the agent resumes after the last event it applied. One stream per
 * agent: a new one replaces it.
 */
export interface AgentStreamOptions {
  events: RouterEvents
  /** Told when this router holds an agent's stream, and when not (several routers: presence). */
  presence?: { opened(agentId: string): void; closed(agentId: string): void }
  /**
   * What agents must present: the agent token; without one, the data plane's API keys (they
   * guard every /v1 route, and must not cover less than they claim); with neither, open
   * (the router then listens on loopback only: config.ts refuses anything else).
   */
  credentials: readonly string[]
  keepAliveMs: number
  /**
   * Gets a handle that ends every stream this router holds: when the log was replaced (Redis
   * restarted empty) every agent must start over, and an ended stream makes it register again.
   */
  onStreams?: (streams: { endAll(): void; unsent(): number }) => void
  /** Runs before a registration is taken (the shared store must be able to record it). */
  beforeRegister?: (req: { method: string }) => Promise<void>
  /** On close, how long to wait for connected agents to acknowledge what was logged, ms. */
  drainMs?: number
  /** Unsent bytes a stream's socket may hold before events wait (default 64 KiB). */
  streamBufferBytes?: number
  /** A stream was cut: it stalled, or a newer one replaced it. */
  onCut?: (reason: StreamCut) => void
}

export type StreamCut = 'stalled' | 'replaced'

/** Events a stream holds to write: a page read from the log, or live ones (at most this many). */
const PAGE = 256

/**
 * A stream's read of the log that has not settled by then ends the stream (the agent resumes
 * after what it applied). Every store command has its own timeout; this is the backstop for a
 * read that never settles at all, which would leave the stream open and silent for good.
 */
const READ_BOUND_MS = 10_000

function bounded<T>(read: Promise<T>): Promise<T> {
  let timer: NodeJS.Timeout | undefined
  const late = new Promise<never>((_, reject) => {
    timer = setTimeout(() => reject(new Error(`the log did not answer within ${READ_BOUND_MS} ms`)), READ_BOUND_MS)
  })
  return Promise.race([read, late]).finally(() => clearTimeout(timer))
}

/**
 * A snapshot's frame, a piece at a time (about `size` bytes each). With many engine_ids gone a
 * snapshot is megabytes, and each stream that fell behind the log gets its own: written whole,
 * a stalled stream would hold its bound plus that much. In pieces it holds its bound plus the
 * list of ids (the log's own strings). SSE frames may be split anywhere; the reader joins them.
 */
export function* snapshotFrame(e: SnapshotEvent, size = 16384): Generator<Buffer> {
  let text = `id: ${e.seq}\ndata: {"seq":${e.seq},"type":"snapshot","goneEngineIds":[`
  for (let i = 0; i < e.goneEngineIds.length; i++) {
    text += `${i === 0 ? '' : ','}${JSON.stringify(e.goneEngineIds[i])}`
    if (text.length >= size) {
      yield Buffer.from(text)
      text = ''
    }
  }
  yield Buffer.from(`${text}],"at":${JSON.stringify(e.at)}}\n\n`)
}

const digits = { type: 'string', pattern: '^[0-9]{1,15}$' } as const

const registered = {
  type: 'object',
  properties: {
    agentId: { type: 'string' },
    instanceId: { type: ['string', 'null'] },
    // The log's last sequence and its id: an agent whose last applied sequence came from another
    // log (a new id after a router restart) starts over from 0.
    lastSeq: { type: 'integer' },
    routerId: { type: 'string' },
    // How often an idle stream gets a keep-alive line: an agent that hears nothing for about
    // three of them takes the router for stalled and follows the next one.
    keepAliveMs: { type: 'integer' },
  },
  required: ['agentId', 'instanceId', 'lastSeq', 'routerId', 'keepAliveMs'],
} as const

export const agentStreamRoutes: FastifyPluginAsync<AgentStreamOptions> = async (app, opts) => {
  const { events } = opts
  const limit = opts.streamBufferBytes ?? 65536
  // Open streams never end by themselves: closing the router ends them, or its server would
  // wait on their connections (fastify only closes idle ones). The agents reconnect.
  const open = new Set<ServerResponse>()
  /** Each agent's stream on this router (one: a new one replaces it). */
  const byAgent = new Map<string, ServerResponse>()
  // Every stream sends the same frame for an event: serialised once.
  const frames = new WeakMap<object, Buffer>()
  const frame = (e: RouterEvent): Buffer => {
    let f = frames.get(e)
    if (f === undefined) {
      f = Buffer.from(`id: ${e.seq}\ndata: ${JSON.stringify(e)}\n\n`)
      frames.set(e, f)
    }
    return f
  }
  const cut = (res: ServerResponse, reason: StreamCut): void => {
    if (res.destroyed) return
    opts.onCut?.(reason)
    res.destroy()
  }
  app.addHook('preClose', async () => {
    // A graceful close loses no event a connected agent can still take: wait (bounded) until
    // every agent with an open stream here has acknowledged everything logged for it. (With
    // the log in Redis a crash loses nothing either: the agents resume on another router.)
    const connected = new Set(events.agents.all().filter((a) => a.streams > 0).map((a) => a.agentId))
    const until = Date.now() + (opts.drainMs ?? 5000)
    while (connected.size > 0 && Date.now() < until) {
      const left = await events.store.undelivered(connected).catch(() => 0)
      if (left === 0) break
      await new Promise((resolve) => setTimeout(resolve, 20))
    }
    endAll()
  })
  const endAll = (): void => {
    for (const res of open) res.end()
  }
  opts.onStreams?.({
    endAll,
    unsent: () => {
      let n = 0
      for (const res of open) n += res.writableLength
      return n
    },
  })
  const check = bearerChecker(opts.credentials)
  if (check) {
    app.addHook('onRequest', async (req) => {
      if (!check(req)) throw new RTR_ERR_AGENT_UNAUTHORIZED()
    })
  }

  app.post<{ Body: AgentRegistration }>('/v1/agents', { schema: { body: { $ref: 'AgentRegistration#' }, response: { 200: registered } } }, async (req) => {
    await opts.beforeRegister?.(req)
    const record = await events.registerAgent(req.body)
    return { agentId: record.agentId, instanceId: record.instanceId ?? null, lastSeq: await events.store.last(), routerId: events.store.id, keepAliveMs: opts.keepAliveMs }
  })

  app.post<{ Params: { agentId: string }; Body: AgentAck }>('/v1/agents/:agentId/acks', { schema: { body: { $ref: 'AgentAck#' } } }, async (req, reply) => {
    if (!events.agents.get(req.params.agentId)) throw new RTR_ERR_AGENT_UNKNOWN(req.params.agentId)
    await events.store.ack(req.params.agentId, req.body.seq)
    return reply.code(204).send()
  })

  app.get<{ Params: { agentId: string }; Querystring: { after?: string } }>(
    '/v1/agents/:agentId/events',
    { schema: { querystring: { type: 'object', properties: { after: digits }, additionalProperties: false } } },
    async (req, reply) => {
      const { agentId } = req.params
      if (!events.agents.get(agentId)) throw new RTR_ERR_AGENT_UNKNOWN(agentId)
      const lastEventId = req.headers['last-event-id']
      const after = Number(typeof lastEventId === 'string' && /^[0-9]{1,15}$/.test(lastEventId) ? lastEventId : (req.query.after ?? '0'))
      let sent = after
      // Events to write, in seq order; `gap`: the log may hold more after them (read on demand).
      let queued: RouterEvent[] = []
      let gap = true
      let overflowed = false
      let reading = false
      let res: ServerResponse | undefined
      // Whether the socket took anything since the last keep-alive tick.
      let moved = true
      // Called as each frame goes out to the kernel: the socket may hold room again. 'drain'
      // would not do: it comes only once a write passed the socket's high-water mark, which
      // can be above `limit` (64 KiB by default from Node 22).
      const flushed = (): void => {
        moved = true
        if (res && res.writableLength <= limit) void pump()
      }
      // The rest of a snapshot being written (see snapshotFrame): it goes before anything else.
      let spilling: Iterator<Buffer> | undefined
      const write = (event: RouterEvent): void => {
        if (event.seq <= sent && event.type !== 'snapshot') return
        sent = Math.max(sent, event.seq)
        if (event.type === 'snapshot') spilling = snapshotFrame(event)
        else (res as ServerResponse).write(frame(event), flushed)
      }
      // Writes while the socket holds at most `limit` unsent; each frame's flush calls it again.
      const pump = async (): Promise<void> => {
        if (reading) return
        reading = true
        try {
          while (res && !res.destroyed && res.writableLength <= limit) {
            if (spilling) {
              const piece = spilling.next()
              if (!piece.done) {
                res.write(piece.value, flushed)
                continue
              }
              spilling = undefined
            }
            const next = queued[0]
            // Sequences are gapless: a live event past the next one means the log holds some
            // between (they came while this stream waited on its reader). Read them from it.
            if (next && next.type !== 'snapshot' && next.seq > sent + 1) {
              queued = []
              gap = true
            } else if (next) {
              queued.shift()
              write(next)
              continue
            }
            if (!gap) break
            overflowed = false
            const page = await bounded(events.store.since(sent, PAGE))
            // Live events that came meanwhile follow the page (repeats are skipped by seq).
            queued = [...page, ...queued]
            gap = page.length >= PAGE || overflowed
            if (page.length === 0 && !gap) break
          }
        } catch (err) {
          req.log.warn({ err, agentId }, 'agent stream: reading the log failed; the stream ends and the agent resumes')
          res?.destroy()
        } finally {
          reading = false
        }
      }
      const unsubscribe = events.store.subscribe((e) => {
        if (queued.length < PAGE) queued.push(e)
        else {
          gap = true
          overflowed = true
        }
        void pump()
      })
      // Whether the agent is known, and the log reachable, before the status goes out.
      let head
      try {
        head = await events.store.since(after, PAGE)
      } catch (err) {
        unsubscribe()
        throw err
      }
      queued = [...head, ...queued]
      gap = head.length >= PAGE || overflowed
      reply.hijack()
      const raw = reply.raw
      res = raw
      raw.writeHead(200, { 'content-type': 'text/event-stream', 'cache-control': 'no-store', connection: 'keep-alive', 'x-accel-buffering': 'no' })
      // Headers now, not with the first event: an agent with nothing to catch up on would
      // otherwise wait for the first keep-alive to learn its stream is open.
      raw.flushHeaders()
      const previous = byAgent.get(agentId)
      if (previous) cut(previous, 'replaced')
      byAgent.set(agentId, raw)
      events.agents.streamOpened(agentId)
      opts.presence?.opened(agentId)
      open.add(raw)
      void pump()
      const keepAlive = setInterval(() => {
        // Took nothing for a whole interval with its buffer full: the reader is stuck or gone.
        if (raw.writableLength > limit && !moved) return cut(raw, 'stalled')
        moved = false
        // Never inside a frame: a snapshot may be part written.
        if (raw.writableLength === 0 && queued.length === 0 && !gap && !spilling) raw.write(': keep-alive\n\n')
      }, opts.keepAliveMs)
      keepAlive.unref()
      raw.once('close', () => {
        clearInterval(keepAlive)
        open.delete(raw)
        unsubscribe()
        queued = []
        events.streamClosed(agentId)
        // A stream that was replaced leaves the agent's presence to the one that replaced it.
        if (byAgent.get(agentId) === raw) {
          byAgent.delete(agentId)
          opts.presence?.closed(agentId)
        }
      })
    },
  )
}
