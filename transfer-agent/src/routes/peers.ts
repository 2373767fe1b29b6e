import type { FastifyPluginAsync } from 'fastify'
import type { PeerGoneRequest } from '../../../schemas/agent-api.js'
import type { TransferAgent } from '../agent.js'

/**
 * What other agents (and ops) call: the handshake a decoder's agent fetches before its first
 * READ, and peer_gone. Registered inside the agent-token scope (app.ts): peers send the same
 * token (handshake-client.ts).
 */
export const peerRoutes: FastifyPluginAsync<{ agent: TransferAgent }> = async (app, { agent }) => {
  app.get('/v1/peer/handshake', async () => agent.handshakeAnswer())

  app.post<{ Body: PeerGoneRequest }>('/v1/peers/gone', { schema: { body: { $ref: 'PeerGoneRequest#' } } }, async (request, reply) => {
    await agent.peerGone(request.body)
    return reply.code(200).send({ applied: true })
  })
}
