import type { FastifyPluginAsync } from 'fastify'
import Type from 'typebox'
import type { TopologyRegistry } from '../topology/registry.js'

const Readiness = Type.Object({
  ready: Type.Boolean(),
  reason: Type.Optional(Type.String()),
  instances: Type.Array(Type.Object({ id: Type.String(), role: Type.String(), healthy: Type.Boolean() })),
})

/**
 * `/health` and `/livez`: the process serves HTTP. `/ready` and `/readyz`: it can route a
 * request now (a healthy instance that decodes) and is not draining.
 */
export const healthRoutes: FastifyPluginAsync<{ registry: TopologyRegistry; isClosing: () => boolean }> = async (app, opts) => {
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
      return reply.code(reason ? 503 : 200).send({ ready: !reason, ...(reason ? { reason } : {}), instances })
    },
  }
  app.get('/ready', ready)
  app.get('/readyz', ready)
}
