import type { FastifyPluginAsync } from 'fastify'
import type { FaultToleranceEvent } from '../../../schemas/events.js'
import { RTR_ERR_EVENT_NOT_FOUND, RTR_ERR_EVENT_OTHER_LOG } from '../errors.js'
import type { RouterEvents } from '../events/router-events.js'

/**
 * `POST /fault_tolerance/event` (ops tooling declares a peer gone) and
 * `GET /fault_tolerance/events/:seq` (who applied it). Registered under the admin guard.
 * Both name the log (`log_id`): a sequence means something only in its log, and a router whose
 * Redis came back empty starts a new one, so `?log=<id>` on the GET refuses a sequence of
 * another log instead of answering for whatever event now has that number.
 * Idempotent: a repeat answers the earlier event's sequence without logging another; unknown
 * engine_ids and addresses are listed as such and change nothing. Addresses are resolved to
 * engine_ids from the topology; the router never dials them.
 */
const strings = { type: 'array', items: { type: 'string' } } as const
const accepted = {
  type: 'object',
  properties: { seq: { type: ['integer', 'null'] }, log_id: { type: 'string' }, engine_ids: strings, unknown: strings, alive_skipped: strings, logged: { type: 'boolean' } },
  required: ['seq', 'log_id', 'engine_ids', 'unknown', 'alive_skipped', 'logged'],
} as const
const delivery = {
  type: 'object',
  properties: {
    seq: { type: 'integer' },
    log_id: { type: 'string' },
    type: { type: 'string' },
    engine_ids: strings,
    applied: strings,
    expected: strings,
    complete: { type: 'boolean' },
  },
  required: ['seq', 'log_id', 'type', 'engine_ids', 'applied', 'expected', 'complete'],
} as const

export const faultToleranceRoutes: FastifyPluginAsync<{ events: RouterEvents }> = async (app, opts) => {
  const { events } = opts
  app.post<{ Body: FaultToleranceEvent }>('/fault_tolerance/event', { schema: { body: { $ref: 'FaultToleranceEvent#' }, response: { 202: accepted } } }, async (req, reply) => {
    const { nodes, reason } = req.body
    const result = await events.peerGone(
      { ...(nodes.engine_ids ? { engineIds: nodes.engine_ids } : {}), ...(nodes.addresses ? { addresses: nodes.addresses } : {}) },
      `ops: ${reason ?? 'no reason given'}`,
    )
    return reply.code(202).send({ seq: result.seq, log_id: events.store.id, engine_ids: result.engineIds, unknown: result.unknown, alive_skipped: result.aliveSkipped, logged: result.logged })
  })

  app.get<{ Params: { seq: string }; Querystring: { log?: string } }>(
    '/fault_tolerance/events/:seq',
    {
      schema: {
        params: { type: 'object', properties: { seq: { type: 'string', pattern: '^[0-9]{1,15}$' } }, required: ['seq'] },
        querystring: { type: 'object', properties: { log: { type: 'string', minLength: 1, maxLength: 200 } }, additionalProperties: false },
        response: { 200: delivery },
      },
    },
    async (req) => {
      const logId = events.store.id
      if (req.query.log !== undefined && req.query.log !== logId) throw new RTR_ERR_EVENT_OTHER_LOG(req.params.seq, req.query.log, logId)
      const found = await events.store.delivery(Number(req.params.seq))
      if (!found) throw new RTR_ERR_EVENT_NOT_FOUND(req.params.seq, `${await events.store.first()}..${await events.store.last()}`)
      const { engineIds, ...rest } = found
      return { ...rest, log_id: logId, engine_ids: engineIds, complete: found.applied.length === found.expected.length }
    },
  )
}
