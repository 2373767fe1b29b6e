import { performance } from 'node:perf_hooks'

export interface LoadResult {
  latenciesMs: number[]
  errors: number
  wallSeconds: number
}

/**
 * A closed loop: `concurrency` workers each send one request after another until
 * `maxRequests` are done or `maxSeconds` pass. Bounded in both count and time.
 */
export async function closedLoop(opts: {
  concurrency: number
  maxRequests: number
  maxSeconds: number
  send: () => Promise<void>
}): Promise<LoadResult> {
  const latenciesMs: number[] = []
  let errors = 0
  let issued = 0
  const start = performance.now()
  const deadline = start + opts.maxSeconds * 1000
  const worker = async (): Promise<void> => {
    while (issued < opts.maxRequests && performance.now() < deadline) {
      issued++
      const t0 = performance.now()
      try {
        await opts.send()
        latenciesMs.push(performance.now() - t0)
      } catch {
        errors++
      }
    }
  }
  await Promise.all(Array.from({ length: opts.concurrency }, worker))
  return { latenciesMs, errors, wallSeconds: (performance.now() - start) / 1000 }
}

export function percentile(sorted: readonly number[], p: number): number {
  if (sorted.length === 0) return Number.NaN
  const idx = Math.min(sorted.length - 1, Math.max(0, Math.ceil((p / 100) * sorted.length) - 1))
  return sorted[idx] as number
}

export function mean(values: readonly number[]): number {
  return values.length ? values.reduce((a, b) => a + b, 0) / values.length : Number.NaN
}

/** Two loads as one: the rounds of one path, added up. */
export function mergeLoads(a: LoadResult, b: LoadResult): LoadResult {
  return { latenciesMs: [...a.latenciesMs, ...b.latenciesMs], errors: a.errors + b.errors, wallSeconds: a.wallSeconds + b.wallSeconds }
}

/** A flag's comma-separated positive numbers (`--concurrency 1,64`), or `fallback` when not given. */
export function positiveList(value: string | undefined, fallback: number[]): number[] {
  if (!value) return fallback
  const out = value.split(',').map((v) => Number(v.trim()))
  if (out.some((n) => !Number.isFinite(n) || n <= 0)) throw new Error(`bad list '${value}'`)
  return out
}
