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
const strings = { type: 'array', items: { type: 'string' } } as const
const accepted = {
  type: 'object',
  properties: { seq: { type: ['integer', 'null'] }, engine_ids: strings, unknown: strings, alive_skipped: strings, logged: { type: 'boolean' } },
  required: ['seq', 'engine_ids', 'unknown', 'alive_skipped', 'logged'],
} as const
const delivery = {
  type: 'object',
  properties: { seq: { type: 'integer' }, type: { type: 'string' }, applied: strings, expected: strings, complete: { type: 'boolean' } },
  required: ['seq', 'type', 'applied', 'expected', 'complete'],
} as const

export const faultToleranceRoutes: FastifyPluginAsync<{ events: RouterEvents }> = async (app, opts) => {
  const { events } = opts
  app.post<{ Body: FaultToleranceEvent }>('/fault_tolerance/event', { schema: { body: { $ref: 'FaultToleranceEvent#' }, response: { 202: accepted } } }, async (req, reply) => {
    const { nodes, reason } = req.body
    const result = await events.peerGone(
      { ...(nodes.engine_ids ? { engineIds: nodes.engine_ids } : {}), ...(nodes.addresses ? { addresses: nodes.addresses } : {}) },
      `ops: ${reason ?? 'no reason given'}`,
    )
    return reply.code(202).send({ seq: result.seq, engine_ids: result.engineIds, unknown: result.unknown, alive_skipped: result.aliveSkipped, logged: result.logged })
  })

  app.get<{ Params: { seq: string } }>(
    '/fault_tolerance/events/:seq',
    { schema: { params: { type: 'object', properties: { seq: { type: 'string', pattern: '^[0-9]{1,15}$' } }, required: ['seq'] }, response: { 200: delivery } } },
    async (req) => {
      const delivery = await events.store.delivery(Number(req.params.seq))
      if (!delivery) throw new RTR_ERR_EVENT_NOT_FOUND(req.params.seq, `${await events.store.first()}..${await events.store.last()}`)
      return { ...delivery, complete: delivery.applied.length === delivery.expected.length }
    },
  )
}
