import type { FastifyPluginAsync } from 'fastify'
import type { TransferAgent } from '../agent.js'
import { xfaError } from '../errors.js'
import { ANSWER_PROOF_HEADER, answerProof, checkHandshake, NonceWindow } from '../peer-proof.js'

/**
 * What other agents call: the handshake a decoder's agent fetches before its first READ. The
 * peer plane's credential is the peer key, never a bearer token (peer-proof.ts): a request
 * needs a proof for this agent's own advertised address, and the answer carries a proof over
 * its body. Without a key (no --peer-secret and no agent token) the plane is open, as the
 * agent listens on loopback unless told otherwise.
 */
export interface PeerRoutesOptions {
  agent: TransferAgent
  peerKey?: Buffer
  /** host:port that peers are told to dial (remote_host:remote_port). */
  ownAddress: () => string
  /** Wall-clock ms. */
  now: () => number
}

export const peerRoutes: FastifyPluginAsync<PeerRoutesOptions> = async (app, { agent, peerKey, ownAddress, now }) => {
  if (peerKey) {
    const nonces = new NonceWindow()
    app.addHook('onRequest', async (request) => {
      const verdict = checkHandshake(peerKey, ownAddress(), request.query as Record<string, unknown>, request.headers.authorization, now(), nonces)
      if (verdict !== 'ok') throw xfaError('XFA_ERR_UNAUTHORIZED', `peer handshake refused (${verdict}): it needs a proof made with this agent's peer secret for ${ownAddress()}`)
    })
    app.addHook('onSend', async (request, reply, payload) => {
      const { nonce } = request.query as { nonce?: string }
      if (reply.statusCode === 200 && typeof nonce === 'string' && (typeof payload === 'string' || Buffer.isBuffer(payload))) {
        reply.header(ANSWER_PROOF_HEADER, answerProof(peerKey, nonce, payload))
      }
      return payload
    })
  }
  app.get('/v1/peer/handshake', async () => agent.handshakeAnswer())
}
