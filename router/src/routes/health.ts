import type { FastifyPluginAsync } from 'fastify'
import Type, { type Static } from 'typebox'
import type { TopologyRegistry } from '../topology/registry.js'

const StoreStatus = Type.Object({
  kind: Type.String(),
  routerId: Type.String(),
  state: Type.Union([Type.Literal('ok'), Type.Literal('degraded')]),
  since: Type.Number(),
  error: Type.Optional(Type.String()),
})

const Readiness = Type.Object({
  ready: Type.Boolean(),
  reason: Type.Optional(Type.String()),
  // `degraded`: Redis is unreachable; the router still routes, from its last topology.
  store: Type.Optional(StoreStatus),
  instances: Type.Array(Type.Object({ id: Type.String(), role: Type.String(), healthy: Type.Boolean() })),
})

/**
 * `/health` and `/livez`: the process serves HTTP. `/ready` and `/readyz`: it can route a
 * request now (a healthy instance that decodes) and is not draining. A store that is
 * `degraded` (Redis away) does not make it unready: it routes from its last topology, and
 * says so in `store`.
 */
export const healthRoutes: FastifyPluginAsync<{ registry: TopologyRegistry; isClosing: () => boolean; store?: () => Static<typeof StoreStatus> }> = async (app, opts) => {
  const live = {
    schema: { response: { 200: Type.Object({ status: Type.Literal('ok') }) } },
    handler: async () => ({ status: 'ok' as const }),
  }
  app.get('/health', live)
  app.get('/livez', live)
  const ready = {
    schema: { response: { 200: Readiness, 503: Readiness } },
    handler: async (_req: unknown, reply: import('fastify').FastifyReply) => {
      const instances = opts.registry.snapshot().instances.map((i) => ({ id: i.id, role: i.role, healthy: i.healthy }))
      let reason: string | undefined
      if (opts.isClosing()) reason = 'shutting down'
      else if (!instances.some((i) => i.healthy && i.role !== 'prefill')) reason = 'no healthy instance can decode'
      const store = opts.store?.()
      return reply.code(reason ? 503 : 200).send({ ready: !reason, ...(reason ? { reason } : {}), ...(store ? { store } : {}), instances })
    },
  }
  app.get('/ready', ready)
  app.get('/readyz', ready)
}
