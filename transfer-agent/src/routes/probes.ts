import type { FastifyPluginAsync } from 'fastify'
import type { TransferAgent } from '../agent.js'
import type { AgentMetrics } from '../metrics.js'

/** `GET /health` and `GET /metrics`: the only routes without the agent token. */
export const probeRoutes: FastifyPluginAsync<{ agent: TransferAgent; metrics: AgentMetrics }> = async (app, { agent, metrics }) => {
  app.get('/health', async () => ({ status: 'ok', agentId: agent.agentId, attached: agent.attachment !== undefined }))
  app.get('/metrics', async (_request, reply) => {
    agent.refreshGauges()
    return reply.type(metrics.registry.contentType).send(await metrics.registry.metrics())
  })
}
