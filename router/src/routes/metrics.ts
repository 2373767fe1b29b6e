import type { FastifyPluginAsync } from 'fastify'
import type { Registry } from 'prom-client'

/** `GET /metrics`: Prometheus text from the router's private registry. */
export const metricsRoutes: FastifyPluginAsync<{ registry: Registry }> = async (app, { registry }) => {
  app.get('/metrics', async (_req, reply) => reply.type(registry.contentType).send(await registry.metrics()))
}
