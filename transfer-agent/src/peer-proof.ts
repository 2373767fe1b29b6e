import { createHash, createHmac, timingSafeEqual } from 'node:crypto'
import { splitHostPort } from '../../common/host-port.js'

/*
 * The agent↔agent credential (issue 18 §2). Agents that handshake share a peer secret
 * (`--peer-secret`; without one, the agent token is the key), and it never goes on the wire:
 *
 * - a handshake request carries HMAC(key, callee engine_id, the address dialled, caller, time,
 *   nonce). The callee takes it only for its own advertised address, within WINDOW_MS of its
 *   clock, and once per nonce. Whoever answers at an address a pull named wrongly learns a
 *   proof that no real agent accepts (it names the wrong address), and no bearer token;
 * - the answer carries HMAC(key, the request's nonce, SHA-256 of the body), so a caller never
 *   loads metadata (and then READs KV) from anyone who does not hold the key.
 *
 * A leaked agent token then opens neither the peer plane (with a peer secret set) nor any
 * other agent's metadata; a leaked peer secret opens no engine API and no router route.
 */

export const PEER_AUTH_SCHEME = 'HandoffPeer'
export const ANSWER_PROOF_HEADER = 'x-handoff-peer-proof'
/** How far a request's time may be from the callee's clock (wall clock: agents on other hosts). */
export const WINDOW_MS = 60_000

export interface HandshakeClaim {
  /** The engine_id the caller expects to reach (the `engine_id` query). */
  callee: string
  /** host:port as dialled: a proof is good at that address only. */
  address: string
  /** The calling agent's id. */
  caller: string
  /** Wall-clock ms when the request was made. */
  ts: number
  /** 32 hex digits, new for every request. */
  nonce: string
}

export function peerKey(secret: string): Buffer {
  return createHash('sha256').update(`handoff-peer-key-v1\n${secret}`).digest()
}

function mac(key: Buffer, text: string): Buffer {
  return createHmac('sha256', key).update(text).digest()
}

function claimText(c: HandshakeClaim): string {
  return ['handoff-peer-handshake-v1', c.callee, normalAddress(c.address), c.caller, String(c.ts), c.nonce].join('\n')
}

/** Lower-case host, IPv6 brackets dropped: the same address however it was written. */
export function normalAddress(address: string): string {
  const { host, port } = splitHostPort(address)
  return `${host.toLowerCase()}:${port}`
}

export function proveHandshake(key: Buffer, claim: HandshakeClaim): string {
  return mac(key, claimText(claim)).toString('hex')
}

export function answerProof(key: Buffer, nonce: string, body: string | Buffer): string {
  const digest = createHash('sha256').update(body).digest('hex')
  return mac(key, `handoff-peer-answer-v1\n${nonce}\n${digest}`).toString('hex')
}

/** Constant-time comparison of two hex MACs (false for anything malformed). */
export function sameProof(expected: string, given: string | undefined): boolean {
  if (typeof given !== 'string' || !/^[0-9a-f]{64}$/.test(given)) return false
  return timingSafeEqual(Buffer.from(expected, 'hex'), Buffer.from(given, 'hex'))
}

/**
 * Nonces seen within the window, so a captured request cannot be played again at the same
 * agent. Bounded: when full, the oldest go first (and a request older than the window is
 * refused by its time anyway).
 */
export class NonceWindow {
  readonly #seen = new Map<string, number>()
  readonly #max: number

  constructor(max = 20_000) {
    this.#max = max
  }

  /** Records `nonce` at `now`; false when it was seen within the window. */
  fresh(nonce: string, now: number): boolean {
    for (const [n, at] of this.#seen) {
      if (now - at <= WINDOW_MS * 2 && this.#seen.size < this.#max) break
      this.#seen.delete(n)
    }
    if (this.#seen.has(nonce)) return false
    this.#seen.set(nonce, now)
    return true
  }
}

const AUTHORIZATION = new RegExp(`^${PEER_AUTH_SCHEME}[ \\t]+(\\S+)$`, 'i')

export type ProofCheck = 'ok' | 'missing' | 'bad_proof' | 'stale' | 'replayed'

/** The callee's side: is this request's proof good for `ownAddress`, now? */
export function checkHandshake(key: Buffer, ownAddress: string, query: Record<string, unknown>, authorization: string | undefined, now: number, nonces: NonceWindow): ProofCheck {
  const m = typeof authorization === 'string' ? AUTHORIZATION.exec(authorization) : null
  const { engine_id: callee, caller, ts, nonce } = query
  if (!m || typeof callee !== 'string' || typeof caller !== 'string' || typeof ts !== 'string' || typeof nonce !== 'string') return 'missing'
  if (!/^[0-9]{1,16}$/.test(ts) || !/^[0-9a-f]{32}$/.test(nonce)) return 'bad_proof'
  const claim: HandshakeClaim = { callee, address: ownAddress, caller, ts: Number(ts), nonce }
  if (!sameProof(proveHandshake(key, claim), m[1])) return 'bad_proof'
  if (Math.abs(now - claim.ts) > WINDOW_MS) return 'stale'
  return nonces.fresh(nonce, now) ? 'ok' : 'replayed'
}
