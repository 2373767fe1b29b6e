import type { ServerResponse } from 'node:http'
import type { FastifyPluginAsync } from 'fastify'
import type { AgentAck, AgentRegistration } from '../../../schemas/events.js'
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
  onStreams?: (streams: { endAll(): void }) => void
  /** Runs before a registration is taken (the shared store must be able to record it). */
  beforeRegister?: (req: { method: string }) => Promise<void>
  /** On close, how long to wait for connected agents to acknowledge what was logged, ms. */
  drainMs?: number
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
  },
  required: ['agentId', 'instanceId', 'lastSeq', 'routerId'],
} as const

export const agentStreamRoutes: FastifyPluginAsync<AgentStreamOptions> = async (app, opts) => {
  const { events } = opts
  // Open streams never end by themselves: closing the router ends them, or its server would
  // wait on their connections (fastify only closes idle ones). The agents reconnect.
  const open = new Set<ServerResponse>()
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
  opts.onStreams?.({ endAll })
  const check = bearerChecker(opts.credentials)
  if (check) {
    app.addHook('onRequest', async (req) => {
      if (!check(req)) throw new RTR_ERR_AGENT_UNAUTHORIZED()
    })
  }

  app.post<{ Body: AgentRegistration }>('/v1/agents', { schema: { body: { $ref: 'AgentRegistration#' }, response: { 200: registered } } }, async (req) => {
    await opts.beforeRegister?.(req)
    const record = await events.registerAgent(req.body)
    return { agentId: record.agentId, instanceId: record.instanceId ?? null, lastSeq: await events.store.last(), routerId: events.store.id }
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
      const send = (event: { seq: number }): void => {
        if (event.seq <= sent && (event as { type?: string }).type !== 'snapshot') return
        sent = Math.max(sent, event.seq)
        res.write(`id: ${event.seq}\ndata: ${JSON.stringify(event)}\n\n`)
      }
      // Subscribe first, then replay: an event logged in between is sent once (seq check).
      const queued: { seq: number }[] = []
      let replaying = true
      const unsubscribe = events.store.subscribe((e) => (replaying ? queued.push(e) : send(e)))
      let backlog
      try {
        backlog = await events.store.since(after)
      } catch (err) {
        unsubscribe()
        throw err
      }
      reply.hijack()
      const res = reply.raw
      res.writeHead(200, { 'content-type': 'text/event-stream', 'cache-control': 'no-store', connection: 'keep-alive', 'x-accel-buffering': 'no' })
      // Headers now, not with the first event: an agent with nothing to catch up on would
      // otherwise wait for the first keep-alive to learn its stream is open.
      res.flushHeaders()
      for (const e of backlog) send(e)
      replaying = false
      for (const e of queued) send(e)
      events.agents.streamOpened(agentId)
      opts.presence?.opened(agentId)
      open.add(res)
      const keepAlive = setInterval(() => res.write(': keep-alive\n\n'), opts.keepAliveMs)
      keepAlive.unref()
      res.once('close', () => {
        clearInterval(keepAlive)
        open.delete(res)
        unsubscribe()
        events.streamClosed(agentId)
        opts.presence?.closed(agentId)
      })
    },
  )
}
