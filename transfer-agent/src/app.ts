import { bearerChecker } from '../../common/bearer.js'
import Fastify, { type FastifyBaseLogger, type FastifyError, type FastifyInstance } from 'fastify'
import type { Logger } from 'pino'
import { sharedSchemas } from '../../schemas/index.js'
import type { AgentAttach, LeaseRequest, PeerGoneRequest, PullRequest } from '../../schemas/agent-api.js'
import type { TransferAgent } from './agent.js'
import { isXfaError, xfaError } from './errors.js'
import type { AgentMetrics } from './metrics.js'
import { isPullFailure } from './pulls.js'

/**
 * The agent's HTTP surface: the engine's API (attach, leases, pulls, events), the peers'
 * handshake, peer_gone, health and metrics. One listener; every body is checked against
 * schemas/agent-api.ts and every failure answers `{error: {code, message}}`.
 */
export interface AgentAppDeps {
  agent: TransferAgent
  metrics: AgentMetrics
  logger: Logger
  agentToken?: string
  /** Upper bound of an events long poll, ms. */
  maxPollMs?: number
}

export function buildAgentApp(deps: AgentAppDeps): FastifyInstance {
  const { agent, metrics } = deps
  const maxPollMs = deps.maxPollMs ?? 30_000
  const app = Fastify({
    loggerInstance: deps.logger as FastifyBaseLogger,
    bodyLimit: 16 * 1024 * 1024,
    disableRequestLogging: true,
    ajv: { customOptions: { removeAdditional: false, coerceTypes: false, useDefaults: true, allErrors: false } },
  })
  for (const s of sharedSchemas) app.addSchema(s)

  const check = bearerChecker(deps.agentToken !== undefined ? [deps.agentToken] : [])
  if (check) {
    app.addHook('onRequest', async (request) => {
      if (!request.url.startsWith('/v1/')) return
      if (!check(request)) throw xfaError('XFA_ERR_UNAUTHORIZED', 'missing or wrong agent token')
    })
  }

  app.setErrorHandler((err: FastifyError, request, reply) => {
    if (err.validation) {
      const e = xfaError('XFA_ERR_INVALID_ARG', err.message)
      return reply.code(400).send({ error: { code: e.code, message: e.message } })
    }
    const status = err.statusCode ?? 500
    const code = isXfaError(err) ? err.code : (err.code ?? 'XFA_ERR_INTERNAL')
    if (status >= 500) request.log.error({ err }, 'request failed')
    return reply.code(status).send({ error: { code, message: err.message } })
  })
  app.setNotFoundHandler((request, reply) => {
    const e = xfaError('XFA_ERR_NOT_FOUND', `${request.method} ${request.url}`)
    return reply.code(404).send({ error: { code: e.code, message: e.message } })
  })

  app.get('/health', async () => ({ status: 'ok', agentId: agent.agentId, attached: agent.attachment !== undefined }))
  app.get('/metrics', async (_request, reply) => {
    agent.refreshGauges()
    return reply.type(metrics.registry.contentType).send(await metrics.registry.metrics())
  })
  app.get('/v1/status', async () => agent.status())

  app.post<{ Body: AgentAttach }>('/v1/engine/attach', { schema: { body: { $ref: 'AgentAttach#' } } }, async (request) => agent.attach(request.body))

  app.post<{ Body: LeaseRequest }>('/v1/leases', { schema: { body: { $ref: 'LeaseRequest#' } } }, async (request, reply) => {
    const { requestId, blockIds, consumers } = request.body
    return reply.code(201).send(agent.lease(requestId, blockIds, consumers))
  })
  app.delete<{ Params: { requestId: string } }>('/v1/leases/:requestId', async (request) => ({ released: agent.release(request.params.requestId) }))

  app.post<{ Body: PullRequest }>('/v1/pulls', { schema: { body: { $ref: 'PullRequest#' } } }, async (request, reply) => {
    // The engine closing its call (its request was aborted) cancels the READ.
    const gone = new AbortController()
    const onClose = (): void => {
      if (!reply.raw.writableEnded) gone.abort(xfaError('XFA_ERR_PULL_CANCELED', 'the engine closed the call'))
    }
    reply.raw.once('close', onClose)
    try {
      return await agent.pull(request.body, gone.signal)
    } catch (err) {
      if (!isPullFailure(err)) throw err
      const { error, invalidBlockIds, tainted } = err
      return reply.code(error.statusCode ?? 500).send({ error: { code: error.code, message: error.message }, invalidBlockIds, tainted })
    }
  })

  // Query values arrive as text and this app never coerces types: digits only, converted here.
  const digits = { type: 'string', pattern: '^[0-9]{1,15}$' }
  app.get<{ Querystring: { after?: string; waitMs?: string } }>(
    '/v1/engine/events',
    { schema: { querystring: { type: 'object', properties: { after: digits, waitMs: digits }, additionalProperties: false } } },
    async (request, reply) => {
      const gone = new AbortController()
      reply.raw.once('close', () => gone.abort())
      const after = Number(request.query.after ?? 0)
      const waitMs = Math.min(Number(request.query.waitMs ?? 0), maxPollMs)
      const events = await agent.events.poll(after, waitMs, gone.signal)
      return { agentId: agent.agentId, events, last: events.length > 0 ? (events[events.length - 1]?.seq ?? after) : Math.max(after, 0) }
    },
  )

  app.get('/v1/peer/handshake', async () => agent.handshakeAnswer())

  app.post<{ Body: PeerGoneRequest }>('/v1/peers/gone', { schema: { body: { $ref: 'PeerGoneRequest#' } } }, async (request, reply) => {
    await agent.peerGone(request.body)
    return reply.code(200).send({ applied: true })
  })

  app.addHook('preClose', async () => {
    await agent.close()
  })
  return app
}
