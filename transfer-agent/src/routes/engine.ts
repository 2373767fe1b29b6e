import type { FastifyPluginAsync } from 'fastify'
import type { AgentAttach, LeaseRequest, PeerGoneRequest, PullExpected, PullRequest } from '../../../schemas/agent-api.js'
import type { TransferAgent } from '../agent.js'
import { xfaError } from '../errors.js'
import { isPullFailure } from '../pulls.js'

/**
 * The engine's API (docs/transfer-agent.md "API"): attach, leases, pulls, the events long
 * poll and status, and peer_gone for ops. Registered inside the agent-token scope (app.ts),
 * never on its own.
 */
export interface EngineRoutesOptions {
  agent: TransferAgent
  /** Upper bound of an events long poll, ms. */
  maxPollMs: number
}

// Query values arrive as text and this app never coerces types: digits only, converted here.
const digits = { type: 'string', pattern: '^[0-9]{1,15}$' }

export const engineRoutes: FastifyPluginAsync<EngineRoutesOptions> = async (app, { agent, maxPollMs }) => {
  app.get('/v1/status', async () => agent.status())

  app.post<{ Body: PeerGoneRequest }>('/v1/peers/gone', { schema: { body: { $ref: 'PeerGoneRequest#' } } }, async (request, reply) => {
    await agent.peerGone(request.body)
    return reply.code(200).send({ applied: true })
  })
  // Whether this agent holds `engineId` as gone (its tombstone: reads from it fail fast), as a
  // peer_gone from the router or ops left it: what ops ask after declaring an engine gone.
  app.get<{ Params: { engineId: string } }>('/v1/peers/gone/:engineId', async (request) => ({ engineId: request.params.engineId, gone: agent.isGone(request.params.engineId) }))

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

  app.post<{ Body: PullExpected }>(
    '/v1/pulls/expected',
    { schema: { body: { $ref: 'PullExpected#' }, response: { 200: { $ref: 'PullExpectation#' } } } },
    async (request) => agent.expect(request.body),
  )

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
}
