import { Agent, request } from 'undici'
import type { Clock } from '../../common/clock.js'
import { createAjv, describeErrors } from '../../schemas/ajv.js'
import type { PeerHandshake } from '../../schemas/agent-api.js'
import { clockSample } from './deadline.js'
import type { Handshake, HandshakeResult } from './peers.js'

/**
 * The agent-to-agent handshake, client side: `GET http://<remote_host>:<remote_port>/v1/peer/
 * handshake`. The answer is checked against its schema; the clock reading is placed inside the
 * request's round trip (deadline.ts clockSample), so its error is at most half of it. The
 * engine_id check against `remote_engine_id` is the peer table's.
 */
export interface HandshakeClientOptions {
  clock: Clock
  timeoutMs: number
  agentToken?: string
}

export function createHandshake(opts: HandshakeClientOptions): { handshake: Handshake; close: () => Promise<void> } {
  const dispatcher = new Agent({ connect: { timeout: opts.timeoutMs }, keepAliveTimeout: 4000 })
  const validate = createAjv({ useDefaults: false }).getSchema<PeerHandshake>('PeerHandshake')
  if (!validate) throw new Error('PeerHandshake schema not registered')
  const handshake: Handshake = async (address, expectedEngineId, signal) => {
    const sentAt = opts.clock.monotonic()
    const res = await request(`http://${address}/v1/peer/handshake?engine_id=${encodeURIComponent(expectedEngineId)}`, {
      dispatcher,
      signal,
      headersTimeout: opts.timeoutMs,
      bodyTimeout: opts.timeoutMs,
      headers: opts.agentToken ? { authorization: `Bearer ${opts.agentToken}` } : {},
    })
    const receivedAt = opts.clock.monotonic()
    const text = await res.body.text()
    if (res.statusCode !== 200) throw new Error(`${address} answered ${res.statusCode}: ${text.slice(0, 300)}`)
    let body: PeerHandshake
    try {
      body = JSON.parse(text) as PeerHandshake
    } catch {
      throw new Error(`${address} answered with a body that is not JSON`)
    }
    if (!validate(body)) throw new Error(`${address} answered a bad handshake: ${describeErrors(validate.errors)}`)
    const result: HandshakeResult = {
      engineId: body.engineId,
      metadata: Buffer.from(body.metadata, 'base64'),
      clock: clockSample(sentAt, body.clock, receivedAt),
      probe: body.probe,
      region: { addr: BigInt(body.region.addr), len: body.region.len, blockBytes: body.region.blockBytes, numBlocks: body.region.numBlocks },
    }
    return result
  }
  return { handshake, close: () => dispatcher.close() }
}
