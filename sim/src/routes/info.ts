import type { FastifyInstance } from 'fastify'
import { sleep } from '../../../common/timers.js'
import type { SimContext } from '../context.js'

/** GET /health, /v1/models and /metrics: what a router probes and scrapes. */
export async function infoRoutes(app: FastifyInstance, ctx: SimContext): Promise<void> {
  const created = Math.floor(ctx.clock.now() / 1000)

  // vLLM answers 200 with an empty body, and 503 once the engine is dead. In `--kv agent`
  // mode also 503 until attached to the agent (and while it is unreachable): no KV can move.
  app.get('/health', { schema: { response: { 200: { type: 'null' }, 503: { type: 'null' } } } }, async (_request, reply) => {
    const delay = ctx.faults.current.healthDelayMs
    if (delay > 0) await sleep(ctx.clock, delay, ctx.shutdown).catch(() => undefined)
    const ok = !ctx.faults.current.unhealthy && (ctx.kv?.ready ?? true)
    return reply.code(ok ? 200 : 503).send()
  })

  app.get('/v1/models', { schema: { response: { 200: { $ref: 'ModelList#' } } } }, async () => ({
    object: 'list',
    data: [
      {
        id: ctx.config.model,
        object: 'model',
        created,
        owned_by: 'vllm',
        root: ctx.config.model,
        parent: null,
        max_model_len: ctx.config.maxModelLen,
      },
    ],
  }))

  app.get('/metrics', { schema: { response: { 200: { type: 'string' } } } }, async (_request, reply) => {
    const text = await ctx.metrics.registry.metrics()
    return reply.type(ctx.metrics.registry.contentType).send(text)
  })
}
