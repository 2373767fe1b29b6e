import { performance } from 'node:perf_hooks'

export interface LoadResult {
  latenciesMs: number[]
  /** When each request of `latenciesMs` finished, in ms since the loop started (same order). */
  doneAtMs: number[]
  errors: number
  wallSeconds: number
}

/**
 * A closed loop: `concurrency` workers each send one request after another until
 * `maxRequests` are done or `maxSeconds` pass. Bounded in both count and time. With
 * `rampSeconds`, worker i starts i/concurrency of it late: long requests that all start
 * together finish together, and a loop of such waves measures where its deadline falls in a
 * wave more than any throughput.
 */
export async function closedLoop(opts: {
  concurrency: number
  maxRequests: number
  maxSeconds: number
  rampSeconds?: number
  send: () => Promise<void>
}): Promise<LoadResult> {
  const latenciesMs: number[] = []
  const doneAtMs: number[] = []
  let errors = 0
  let issued = 0
  const start = performance.now()
  const deadline = start + opts.maxSeconds * 1000
  const worker = async (i: number): Promise<void> => {
    const delay = ((opts.rampSeconds ?? 0) * 1000 * i) / opts.concurrency
    if (delay > 0) await new Promise((r) => setTimeout(r, delay))
    while (issued < opts.maxRequests && performance.now() < deadline) {
      issued++
      const t0 = performance.now()
      try {
        await opts.send()
        const t1 = performance.now()
        latenciesMs.push(t1 - t0)
        doneAtMs.push(t1 - start)
      } catch {
        errors++
      }
    }
  }
  await Promise.all(Array.from({ length: opts.concurrency }, (_, i) => worker(i)))
  return { latenciesMs, doneAtMs, errors, wallSeconds: (performance.now() - start) / 1000 }
}

export function percentile(sorted: readonly number[], p: number): number {
  if (sorted.length === 0) return Number.NaN
  const idx = Math.min(sorted.length - 1, Math.max(0, Math.ceil((p / 100) * sorted.length) - 1))
  return sorted[idx] as number
}

export function mean(values: readonly number[]): number {
  return values.length ? values.reduce((a, b) => a + b, 0) / values.length : Number.NaN
}

/** A load with nothing in it yet (rounds are merged onto it). */
export function emptyLoad(): LoadResult {
  return { latenciesMs: [], doneAtMs: [], errors: 0, wallSeconds: 0 }
}

/** Two loads as one: the rounds of one path, added up. */
export function mergeLoads(a: LoadResult, b: LoadResult): LoadResult {
  // Finish times of b follow a's loop.
  return { latenciesMs: [...a.latenciesMs, ...b.latenciesMs], doneAtMs: [...a.doneAtMs, ...b.doneAtMs.map((t) => t + a.wallSeconds * 1000)], errors: a.errors + b.errors, wallSeconds: a.wallSeconds + b.wallSeconds }
}

/** A flag's comma-separated positive numbers (`--concurrency 1,64`), or `fallback` when not given. */
export function positiveList(value: string | undefined, fallback: number[]): number[] {
  if (!value) return fallback
  const out = value.split(',').map((v) => Number(v.trim()))
  if (out.some((n) => !Number.isFinite(n) || n <= 0)) throw new Error(`bad list '${value}'`)
  return out
}
