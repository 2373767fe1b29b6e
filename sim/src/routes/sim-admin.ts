import type { FastifyInstance } from 'fastify'
import Type from 'typebox'
import type { SimContext } from '../context.js'
import type { FaultsPatch } from '../faults.js'

/** POST /sim/faults takes any subset of the fault settings; unknown keys are rejected. */
export const FaultsPatchSchema = Type.Object(
  {
    errorRate: Type.Optional(Type.Number({ minimum: 0, maximum: 1 })),
    stallRate: Type.Optional(Type.Number({ minimum: 0, maximum: 1 })),
    stallMs: Type.Optional(Type.Number({ minimum: 0 })),
    crashAfter: Type.Optional(Type.Union([Type.Integer({ minimum: 1 }), Type.Null()])),
    garbageRate: Type.Optional(Type.Number({ minimum: 0, maximum: 1 })),
    disconnectRate: Type.Optional(Type.Number({ minimum: 0, maximum: 1 })),
    kvLoadFailureRate: Type.Optional(Type.Number({ minimum: 0, maximum: 1 })),
    unhealthy: Type.Optional(Type.Boolean()),
    healthDelayMs: Type.Optional(Type.Integer({ minimum: 0 })),
    eosAfterTokens: Type.Optional(Type.Union([Type.Integer({ minimum: 1 }), Type.Null()])),
  },
  { additionalProperties: false },
)

const FaultsView = Type.Object(
  {
    errorRate: Type.Number(),
    stallRate: Type.Number(),
    stallMs: Type.Number(),
    crashAfter: Type.Optional(Type.Integer()),
    garbageRate: Type.Number(),
    disconnectRate: Type.Number(),
    kvLoadFailureRate: Type.Number(),
    unhealthy: Type.Boolean(),
    healthDelayMs: Type.Integer(),
    eosAfterTokens: Type.Optional(Type.Integer()),
  },
  { additionalProperties: false },
)

const RecordedRequestView = Type.Object(
  {
    seq: Type.Integer(),
    receivedAt: Type.Number(),
    method: Type.String(),
    path: Type.String(),
    xRequestId: Type.Union([Type.String(), Type.Null()]),
    headers: Type.Object({}, { additionalProperties: true }),
    body: Type.Optional(Type.Unknown()),
    finishReason: Type.Optional(Type.String()),
    stopReason: Type.Optional(Type.Union([Type.String(), Type.Integer(), Type.Null()])),
    kvTransferParams: Type.Optional(Type.Union([Type.Object({}, { additionalProperties: true }), Type.Null()])),
    kvLoad: Type.Optional(Type.Union([Type.Literal('ok'), Type.Literal('failed'), Type.Literal('recomputed')])),
    kvLoadError: Type.Optional(Type.String()),
  },
  { additionalProperties: false },
)

const errorResponses = { '4xx': { $ref: 'ErrorBody#' } }

/** Test and chaos controls. Not part of vLLM's surface; a router never calls them. */
export async function simAdminRoutes(app: FastifyInstance, ctx: SimContext): Promise<void> {
  app.get('/sim/faults', { schema: { response: { 200: FaultsView } } }, async () => ctx.faults.current)

  app.post<{ Body: FaultsPatch }>(
    '/sim/faults',
    { schema: { body: FaultsPatchSchema, response: { 200: FaultsView, ...errorResponses } } },
    async (request) => {
      const next = ctx.faults.update(request.body)
      request.log.warn({ faults: next }, 'faults changed')
      return next
    },
  )

  app.get(
    '/sim/requests',
    { schema: { response: { 200: Type.Object({ requests: Type.Array(RecordedRequestView) }, { additionalProperties: false }) } } },
    async () => ({ requests: ctx.requests.list() }),
  )

  app.post('/sim/requests/clear', { schema: { response: { 204: { type: 'null' } } } }, async (_request, reply) => {
    ctx.requests.clear()
    return reply.code(204).send()
  })

  // Engine identity and KV occupancy, for tests and the transfer agent's registration later.
  app.get(
    '/sim/info',
    {
      schema: {
        response: {
          200: Type.Object(
            {
              engineId: Type.String(),
              // Every data-parallel rank's engine_id, in rank order (engineId is the first).
              engineIds: Type.Array(Type.String()),
              role: Type.String(),
              kv: Type.String(),
              model: Type.String(),
              blockSize: Type.Integer(),
              bytesPerToken: Type.Integer(),
              numBlocks: Type.Integer(),
              usedBlocks: Type.Integer(),
              // Blocks holding a hash (free or in use): what a prefix can hit.
              cachedBlocks: Type.Integer(),
              // --kv-events-config: where the events go (ports resolved) and how many
              // batches went out; null without events.
              kvEvents: Type.Union([
                Type.Object(
                  { endpoint: Type.String(), replayEndpoint: Type.Union([Type.String(), Type.Null()]), sequence: Type.Integer(), dropped: Type.Integer() },
                  { additionalProperties: false },
                ),
                Type.Null(),
              ]),
              // `--kv agent`: leases held for decoders, blocks of failed pulls not yet
              // quiescent, and whether the engine is attached to its agent.
              leases: Type.Integer(),
              taintedBlocks: Type.Integer(),
              agentAttached: Type.Boolean(),
            },
            { additionalProperties: false },
          ),
        },
      },
    },
    async () => ({
      engineId: ctx.engines.map((e) => e.engineId)[0] as string,
      engineIds: ctx.engines.map((e) => e.engineId),
      role: ctx.config.role,
      kv: ctx.config.kv,
      model: ctx.config.model,
      blockSize: ctx.region.blockSize,
      bytesPerToken: ctx.region.bytesPerToken,
      numBlocks: ctx.region.numBlocks,
      usedBlocks: ctx.pool.usedCount,
      cachedBlocks: ctx.pool.cachedCount,
      kvEvents: ctx.kvEvents
        ? { endpoint: ctx.kvEvents.endpoint, replayEndpoint: ctx.kvEvents.replayEndpoint ?? null, sequence: Number(ctx.kvEvents.sequence), dropped: ctx.kvEvents.dropped }
        : null,
      leases: ctx.kv?.leases ?? 0,
      taintedBlocks: ctx.kv?.taintedBlocks ?? 0,
      agentAttached: ctx.kv?.ready ?? false,
    }),
  )
}
