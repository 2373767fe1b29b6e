import { processSchemaController } from '../../common/schema-compilers.js'
import { bearerChecker } from '../../common/bearer.js'
import { limitJsonDepth } from '../../common/json-body.js'
import { redactQuery, withRequestSerializers } from '../../common/logger.js'
import Fastify, { type FastifyBaseLogger, type FastifyError, type FastifyInstance, type FastifyPluginAsync } from 'fastify'
import type { Logger } from 'pino'
import { sharedSchemas } from '../../schemas/index.js'
import type { TransferAgent } from './agent.js'
import { isXfaError, xfaError } from './errors.js'
import type { AgentMetrics } from './metrics.js'
import { engineRoutes } from './routes/engine.js'
import { peerRoutes } from './routes/peers.js'
import { probeRoutes } from './routes/probes.js'

/**
 * The agent's HTTP surface, one listener composed of three plugins: the probes (health,
 * metrics; public), the engine's API (routes/engine.ts, in the agent-token scope) and the
 * peers' (routes/peers.ts, the peer key's proofs). Every body is checked against
 * schemas/agent-api.ts and every failure answers `{error: {code, message}}`.
 */
export interface AgentAppDeps {
  agent: TransferAgent
  metrics: AgentMetrics
  logger: Logger
  agentToken?: string
  /** The peer plane's key (peer-proof.ts peerKey); unset: the handshake is open. */
  peerKey?: Buffer
  /** Wall-clock ms, for the peer proofs' time window (default Date.now). */
  now?: () => number
  /** Upper bound of an events long poll, ms. */
  maxPollMs?: number
}

export function buildAgentApp(deps: AgentAppDeps): FastifyInstance {
  const { agent, metrics } = deps
  const maxPollMs = deps.maxPollMs ?? 30_000
  const app = Fastify({
    loggerInstance: withRequestSerializers(deps.logger) as FastifyBaseLogger,
    bodyLimit: 16 * 1024 * 1024,
    disableRequestLogging: true,
    ajv: { customOptions: { removeAdditional: false, coerceTypes: false, useDefaults: true, allErrors: false } },
    // Each schema compiled once per process, not once per app and route (common/schema-compilers.ts).
    schemaController: processSchemaController,
  })
  for (const s of sharedSchemas) app.addSchema(s)
  limitJsonDepth(app)

  app.setErrorHandler((err: FastifyError, request, reply) => {
    // A body that is no JSON, empty, or nested too deep is a caller mistake like a bad field.
    if (err.validation || err instanceof SyntaxError || err.code === 'FST_ERR_CTP_INVALID_JSON_BODY' || err.code === 'FST_ERR_CTP_EMPTY_JSON_BODY') {
      const e = xfaError('XFA_ERR_INVALID_ARG', err.message)
      return reply.code(400).send({ error: { code: e.code, message: e.message } })
    }
    const status = err.statusCode ?? 500
    const code = isXfaError(err) ? err.code : (err.code ?? 'XFA_ERR_INTERNAL')
    if (status >= 500) request.log.error({ err }, 'request failed')
    return reply.code(status).send({ error: { code, message: err.message } })
  })
  app.setNotFoundHandler((request, reply) => {
    const e = xfaError('XFA_ERR_NOT_FOUND', `${request.method} ${redactQuery(request.url)}`)
    return reply.code(404).send({ error: { code: e.code, message: e.message } })
  })

  // Probes are the only public routes. Every other route lives in a scope that checks its
  // credential in its own onRequest hook, which runs after routing and so guards exactly the
  // routes of that scope whatever the request target looked like (issue 18: a prefix test on
  // request.url missed absolute-form and percent-encoded targets that the router matches).
  const check = bearerChecker(deps.agentToken !== undefined ? [deps.agentToken] : [])
  void app.register(probeRoutes, { agent, metrics })
  void app.register(guarded(engineRoutes, check), { agent, maxPollMs })
  void app.register(peerRoutes, { agent, now: deps.now ?? Date.now, ownAddress: () => agent.peerAddress, ...(deps.peerKey ? { peerKey: deps.peerKey } : {}) })

  app.addHook('preClose', async () => {
    await agent.close()
  })
  return app
}

/**
 * `routes` in an encapsulated scope of its own whose every route needs the agent token (when
 * one is set): the check is the scope's onRequest hook, never a test on the URL.
 */
function guarded<O extends object>(routes: FastifyPluginAsync<O>, check: ReturnType<typeof bearerChecker>): FastifyPluginAsync<O> {
  return async (scope, opts) => {
    if (check) {
      scope.addHook('onRequest', async (request) => {
        if (!check(request)) throw xfaError('XFA_ERR_UNAUTHORIZED', 'missing or wrong agent token')
      })
    }
    await scope.register(routes, opts)
  }
}
