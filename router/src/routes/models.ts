import type { FastifyPluginAsync } from 'fastify'
import type { ModelList } from '../../../schemas/openai.js'
import type { TopologyRegistry } from '../topology/registry.js'

/** `GET /v1/models`: the union of the models the instances serve. */
export const modelRoutes: FastifyPluginAsync<{ registry: TopologyRegistry; startedAt: number }> = async (app, opts) => {
  app.get('/v1/models', {
    schema: { response: { 200: { $ref: 'ModelList#' } } },
    handler: async (): Promise<ModelList> => {
      const models = [...opts.registry.snapshot().models].sort()
      return {
        object: 'list',
        data: models.map((id) => ({ id, object: 'model' as const, created: Math.floor(opts.startedAt / 1000), owned_by: 'handoff' })),
      }
    },
  })
}
