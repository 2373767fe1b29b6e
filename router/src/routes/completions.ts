import type { FastifyPluginAsync } from 'fastify'
import type { CompletionProxy } from '../proxy/proxy.js'

const errorResponses = {
  '4xx': { $ref: 'ErrorBody#' },
  '5xx': { $ref: 'ErrorBody#' },
}

/**
 * OpenAI completion routes. Bodies are validated against the shared schemas and otherwise
 * passed through; answers are relayed as the engine sent them (no re-serialisation).
 */
export const completionRoutes: FastifyPluginAsync<{ proxy: CompletionProxy }> = async (app, { proxy }) => {
  app.post('/v1/chat/completions', {
    schema: {
      body: { $ref: 'ChatCompletionRequest#' },
      response: { 200: { $ref: 'ChatCompletionResponse#' }, ...errorResponses },
    },
    handler: (req, reply) => proxy.handle(req, reply, '/v1/chat/completions'),
  })
  app.post('/v1/completions', {
    schema: {
      body: { $ref: 'CompletionRequest#' },
      response: { 200: { $ref: 'CompletionResponse#' }, ...errorResponses },
    },
    handler: (req, reply) => proxy.handle(req, reply, '/v1/completions'),
  })
}
