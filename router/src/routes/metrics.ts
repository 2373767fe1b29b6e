import type { FastifyPluginAsync } from 'fastify'
import type { OpenMetricsContentType, PrometheusContentType, Registry } from 'prom-client'

/** `GET /metrics`: the router's private registry, in its own text format (Prometheus or OpenMetrics). */
export const metricsRoutes: FastifyPluginAsync<{ registry: Registry<PrometheusContentType> | Registry<OpenMetricsContentType> }> = async (app, { registry }) => {
  app.get('/metrics', async (_req, reply) => reply.type(registry.contentType).send(await registry.metrics()))
}
