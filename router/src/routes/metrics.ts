import type { FastifyPluginAsync } from 'fastify'
import type { OpenMetricsContentType, PrometheusContentType, Registry } from 'prom-client'

/**
 * `GET /metrics`: the router's private registry, in its own text format (Prometheus or
 * OpenMetrics). `beforeScrape` refreshes gauges that are cheaper to read than to keep current.
 */
export const metricsRoutes: FastifyPluginAsync<{
  registry: Registry<PrometheusContentType> | Registry<OpenMetricsContentType>
  beforeScrape?: () => void
}> = async (app, { registry, beforeScrape }) => {
  app.get('/metrics', async (_req, reply) => {
    beforeScrape?.()
    return reply.type(registry.contentType).send(await registry.metrics())
  })
}
