import { randomBytes } from 'node:crypto'

/** Randomness is injected like time: ids and jitter come from a `Random` the caller chooses. */
export interface Random {
  /** A float in [0, 1). */
  next(): number
  /** `n` random bytes as lowercase hex. */
  hex(bytes: number): string
}

/**
 * The operating system's randomness. Small ids are cut from a pool refilled `poolBytes` at a
 * time: one randomBytes call per id cost ~20 µs per request in a router profile (Node's
 * randomUUID pools the same way).
 */
export function createSystemRandom(poolBytes = 4096): Random {
  let pool = Buffer.alloc(0)
  let offset = 0
  return Object.freeze({
    next: () => Math.random(),
    hex: (bytes: number) => {
      if (bytes > poolBytes) return randomBytes(bytes).toString('hex')
      if (offset + bytes > pool.length) {
        pool = randomBytes(poolBytes)
        offset = 0
      }
      const out = pool.toString('hex', offset, offset + bytes)
      offset += bytes
      return out
    },
  })
}

export const systemRandom: Random = createSystemRandom()

/** Deterministic generator (mulberry32) for tests and reproducible simulations. */
export function seededRandom(seed: number): Random {
  let a = seed >>> 0
  const next = (): number => {
    a = (a + 0x6d2b79f5) >>> 0
    let t = a
    t = Math.imul(t ^ (t >>> 15), t | 1)
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61)
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296
  }
  return {
    next,
    hex(bytes: number) {
      let out = ''
      for (let i = 0; i < bytes; i++) out += Math.floor(next() * 256).toString(16).padStart(2, '0')
      return out
    },
  }
}
