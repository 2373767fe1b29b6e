import type { FastifyPluginAsync } from 'fastify'
import type { ModelList } from '../../../schemas/openai.js'
import type { ModelCard } from '../topology/prober.js'
import type { TopologyRegistry } from '../topology/registry.js'

/**
 * `GET /v1/models`: the union of the models the instances serve, each with the card an engine
 * gave for it (vLLM's root, parent, max_model_len, permission: clients size prompts by
 * max_model_len), or a plain card where none was read.
 */
export const modelRoutes: FastifyPluginAsync<{ registry: TopologyRegistry; startedAt: number; card: (model: string) => ModelCard | undefined }> = async (app, opts) => {
  app.get('/v1/models', {
    schema: { response: { 200: { $ref: 'ModelList#' } } },
    handler: async (): Promise<ModelList> => {
      const models = [...opts.registry.snapshot().models].sort()
      return {
        object: 'list',
        data: models.map((id) => ({ created: Math.floor(opts.startedAt / 1000), owned_by: 'handoff', ...opts.card(id), id, object: 'model' as const })),
      }
    },
  })
}
