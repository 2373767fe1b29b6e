import { randomBytes } from 'node:crypto'
import { Agent, request } from 'undici'
import type { Clock } from '../../common/clock.js'
import { createAjv, describeErrors } from '../../schemas/ajv.js'
import type { PeerHandshake } from '../../schemas/agent-api.js'
import { betterSample, clockSample, type ClockSample } from './deadline.js'
import { ANSWER_PROOF_HEADER, answerProof, PEER_AUTH_SCHEME, proveHandshake, sameProof } from './peer-proof.js'
import type { Handshake, HandshakeResult } from './peers.js'
import { hostPort, splitHostPort } from '../../common/host-port.js'

/**
 * The agent-to-agent handshake, client side: `GET http://<remote_host>:<remote_port>/v1/peer/
 * handshake`. The answer is checked against its schema; the clock reading is placed inside the
 * request's round trip (deadline.ts clockSample), so its error is at most half of it. The
 * request is sent `samples` times on one connection and the tightest reading kept (the
 * lowest round trip, as vLLM keeps the best of its handshakes): one slow round trip (a GC
 * pause, a busy peer) would otherwise widen every margin, or break the deadline proof, for as
 * long as the handshake is cached. The engine_id check against `remote_engine_id` is the peer
 * table's; every sample must come from the same NIXL agent. With a peer key, every request
 * carries a proof for the address dialled and every answer must carry one over its body
 * (peer-proof.ts); no bearer token is ever sent to a peer.
 */
export interface HandshakeClientOptions {
  clock: Clock
  timeoutMs: number
  /** The peer key (peer-proof.ts peerKey); unset: peers are not authenticated. */
  peerKey?: Buffer
  /** This agent's id, named in every proof. */
  caller: string
  /** Clock samples per handshake (default 3). */
  samples?: number
}

export function createHandshake(opts: HandshakeClientOptions): { handshake: Handshake; close: () => Promise<void> } {
  const dispatcher = new Agent({ connect: { timeout: opts.timeoutMs }, keepAliveTimeout: 4000 })
  const validate = createAjv({ useDefaults: false }).getSchema<PeerHandshake>('PeerHandshake')
  if (!validate) throw new Error('PeerHandshake schema not registered')
  const samples = opts.samples ?? 3
  if (!(Number.isInteger(samples) && samples >= 1)) throw new RangeError(`handshake samples must be a positive integer, got ${samples}`)
  const once = async (address: string, expectedEngineId: string, signal: AbortSignal): Promise<{ body: PeerHandshake; clock: ClockSample }> => {
    const { host, port } = splitHostPort(address)
    const url = new URL(`http://${hostPort(host, port)}/v1/peer/handshake`)
    url.searchParams.set('engine_id', expectedEngineId)
    const nonce = opts.peerKey ? randomBytes(16).toString('hex') : ''
    const headers: Record<string, string> = {}
    if (opts.peerKey) {
      const ts = Math.round(opts.clock.now())
      url.searchParams.set('caller', opts.caller)
      url.searchParams.set('ts', String(ts))
      url.searchParams.set('nonce', nonce)
      headers.authorization = `${PEER_AUTH_SCHEME} ${proveHandshake(opts.peerKey, { callee: expectedEngineId, address, caller: opts.caller, ts, nonce })}`
    }
    const sentAt = opts.clock.monotonic()
    const res = await request(url, { dispatcher, signal, headersTimeout: opts.timeoutMs, bodyTimeout: opts.timeoutMs, headers })
    const receivedAt = opts.clock.monotonic()
    const text = await res.body.text()
    if (res.statusCode !== 200) throw new Error(`${address} answered ${res.statusCode}: ${text.slice(0, 300)}`)
    if (opts.peerKey && !sameProof(answerProof(opts.peerKey, nonce, text), headerValue(res.headers[ANSWER_PROOF_HEADER]))) {
      throw new Error(`${address} answered without a valid peer proof: it does not hold this agent's peer secret`)
    }
    let body: PeerHandshake
    try {
      body = JSON.parse(text) as PeerHandshake
    } catch {
      throw new Error(`${address} answered with a body that is not JSON`)
    }
    if (!validate(body)) throw new Error(`${address} answered a bad handshake: ${describeErrors(validate.errors)}`)
    return { body, clock: clockSample(sentAt, body.clock, receivedAt) }
  }
  const handshake: Handshake = async (address, expectedEngineId, signal) => {
    const first = await once(address, expectedEngineId, signal)
    let clock = first.clock
    for (let i = 1; i < samples; i++) {
      const next = await once(address, expectedEngineId, signal)
      if (next.body.engineId !== first.body.engineId || next.body.metadata !== first.body.metadata) {
        throw new Error(`${address} changed while it was sampled (${first.body.engineId} → ${next.body.engineId}): another engine answers there`)
      }
      clock = betterSample(clock, next.clock)
    }
    const { body } = first
    const result: HandshakeResult = {
      engineId: body.engineId,
      metadata: Buffer.from(body.metadata, 'base64'),
      clock,
      probe: body.probe,
      region: { addr: BigInt(body.region.addr), len: body.region.len, blockBytes: body.region.blockBytes, numBlocks: body.region.numBlocks },
    }
    return result
  }
  return { handshake, close: () => dispatcher.close() }
}

function headerValue(v: string | string[] | undefined): string | undefined {
  return Array.isArray(v) ? v[0] : v
}
