import type { FastifyInstance } from 'fastify'
import type { TokenizeChatRequest, TokenizeCompletionRequest, TokenizeResponse } from '../../../schemas/openai.js'
import { renderChat } from '../chat-template.js'
import type { SimContext } from '../context.js'
import { SIM_ERR_BAD_REQUEST, SIM_ERR_MODEL_NOT_FOUND } from '../errors.js'
import { tokenize } from '../tokenizer.js'

const errorResponses = { '4xx': { $ref: 'ErrorBody#' }, '5xx': { $ref: 'ErrorBody#' } }

/**
 * POST /tokenize, as vLLM serves it: a completion prompt or chat messages (the template
 * applied, the generation prompt by default) to the token ids a request with the same fields
 * would be served on (prompt.ts renders them the same way). The simulator's tokenizer has no
 * special tokens, so `add_special_tokens` changes nothing here.
 */
export async function tokenizeRoutes(app: FastifyInstance, ctx: SimContext): Promise<void> {
  app.post<{ Body: TokenizeCompletionRequest | TokenizeChatRequest }>(
    '/tokenize',
    {
      schema: {
        body: { anyOf: [{ $ref: 'TokenizeChatRequest#' }, { $ref: 'TokenizeCompletionRequest#' }] },
        response: { 200: { $ref: 'TokenizeResponse#' }, ...errorResponses },
      },
    },
    async (request): Promise<TokenizeResponse> => {
      const body = request.body
      if (body.model !== undefined && body.model !== null && body.model !== ctx.config.model) throw new SIM_ERR_MODEL_NOT_FOUND(body.model)
      let tokens: Uint32Array
      if ('messages' in body) {
        if (body.continue_final_message && body.add_generation_prompt) {
          throw new SIM_ERR_BAD_REQUEST('Cannot set both `continue_final_message` and `add_generation_prompt` to True.')
        }
        tokens = tokenize(renderChat(body.messages, { addGenerationPrompt: body.add_generation_prompt ?? true }))
      } else {
        tokens = tokenize(body.prompt)
      }
      return { count: tokens.length, max_model_len: ctx.config.maxModelLen, tokens: Array.from(tokens) }
    },
  )
}
