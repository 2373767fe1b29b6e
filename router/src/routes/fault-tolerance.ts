import type { FastifyPluginAsync } from 'fastify'
import type { FaultToleranceEvent } from '../../../schemas/events.js'
import { RTR_ERR_EVENT_NOT_FOUND } from '../errors.js'
import type { RouterEvents } from '../events/router-events.js'

/**
 * `POST /fault_tolerance/event` (ops tooling declares a peer gone) and
 * `GET /fault_tolerance/events/:seq` (who applied it). Registered under the admin guard.
 * Idempotent: a repeat answers the earlier event's sequence without logging another; unknown
 * engine_ids and addresses are listed as such and change nothing. Addresses are resolved to
 * engine_ids from the topology; the router never dials them.
 */
export const faultToleranceRoutes: FastifyPluginAsync<{ events: RouterEvents }> = async (app, opts) => {
  const { events } = opts
  app.post<{ Body: FaultToleranceEvent }>('/fault_tolerance/event', { schema: { body: { $ref: 'FaultToleranceEvent#' } } }, async (req, reply) => {
    const { nodes, reason } = req.body
    const result = events.peerGone(
      { ...(nodes.engine_ids ? { engineIds: nodes.engine_ids } : {}), ...(nodes.addresses ? { addresses: nodes.addresses } : {}) },
      `ops: ${reason ?? 'no reason given'}`,
    )
    return reply.code(202).send({ seq: result.seq, engine_ids: result.engineIds, unknown: result.unknown, logged: result.logged })
  })

  app.get<{ Params: { seq: string } }>(
    '/fault_tolerance/events/:seq',
    { schema: { params: { type: 'object', properties: { seq: { type: 'string', pattern: '^[0-9]{1,15}$' } }, required: ['seq'] } } },
    async (req) => {
      const delivery = events.log.delivery(Number(req.params.seq))
      if (!delivery) throw new RTR_ERR_EVENT_NOT_FOUND(req.params.seq, `${events.log.first}..${events.log.last}`)
      return { ...delivery, complete: delivery.applied.length === delivery.expected.length }
    },
  )
}
