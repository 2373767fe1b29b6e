import { createHash, timingSafeEqual } from 'node:crypto'

/** What the check reads of a request (fastify's and node's requests both fit). */
export interface WithAuthorization {
  headers: { authorization?: string | undefined }
}

/**
 * Bearer-key check with constant-time comparison, shared by the router and the agent. Keys are compared as SHA-256 digests so
 * neither the content nor the length of a configured key leaks through timing.
 */
export function bearerChecker(keys: readonly string[]): ((req: WithAuthorization) => boolean) | undefined {
  if (keys.length === 0) return undefined
  const digests = keys.map((k) => createHash('sha256').update(k).digest())
  return (req) => {
    const header = req.headers.authorization
    // The auth scheme is case-insensitive (RFC 9110 §11.1).
    const m = typeof header === 'string' ? /^bearer[ \t]+(.*)$/i.exec(header) : null
    if (!m) return false
    const given = createHash('sha256').update((m[1] as string).trim()).digest()
    let ok = false
    // Check every key (no early exit) to keep the time independent of which key matched.
    for (const d of digests) ok = timingSafeEqual(d, given) || ok
    return ok
  }
}
