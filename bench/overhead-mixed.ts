import { cpus, totalmem } from 'node:os'
import { Agent, request } from 'undici'
import { closedLoop, percentile } from './load.js'
import { startBenchCluster } from './cluster.js'

/**
 * `handoff bench overhead --mixed` (issue 37 item 4): how often a checked read is still proven
 * by D's whole answer (leases.proveByWholeAnswer) on a workload of short and long generations
 * with some queueing at the decoder, the case where one slow answer used to switch the proof
 * off for a decoder. Every other read of a non-streamed request costs a streamed decode leg
 * the router assembles (or, one that missed the window, a second prefill).
 */
export interface MixedOptions {
  concurrency: number
  seconds: number
  shortTokens: number
  longTokens: number
  /** Shares of long requests, one cell each (0..1). */
  longShares: number[]
  leaseSeconds: number[]
  decodeDelayMs: number
  maxNumSeqs: number
  baseline: string | undefined
}

interface CellResult {
  ok: number
  errors: number
  reqPerS: number
  whole: number
  unproven: number
  late: number
  shortP99: number
  longP99: number
}

function counter(text: string, name: string): number {
  return Number(new RegExp(`^${name} (\\d+)`, 'm').exec(text)?.[1] ?? 0)
}

async function cell(o: MixedOptions, longShare: number, leaseSeconds: number, entry: string | undefined): Promise<CellResult> {
  const cluster = await startBenchCluster({
    decodeDelayMs: o.decodeDelayMs,
    decodeArgs: ['--max-num-seqs', String(o.maxNumSeqs)],
    routerEnv: { HANDOFF_LEASE_SECONDS: String(leaseSeconds) },
  })
  const agent = new Agent({ connections: o.concurrency + 2, keepAliveTimeout: 30_000 })
  try {
    const router = await cluster.router(entry)
    const metrics = async (): Promise<string> => (await request(`${router.url}/metrics`, { dispatcher: agent })).body.text()
    const before = await metrics()
    const latencies = { short: [] as number[], long: [] as number[] }
    let ok = 0
    let errors = 0
    // Every request draws its kind from one seeded sequence, so both builds get the same mix.
    let seed = 0x9e3779b9
    const nextIsLong = (): boolean => {
      seed = (Math.imul(seed ^ (seed >>> 15), 0x2c1b3c6d) + 0x6d2b79f5) >>> 0
      return seed / 2 ** 32 < longShare
    }
    const load = await closedLoop({
      concurrency: o.concurrency,
      maxRequests: Number.MAX_SAFE_INTEGER,
      maxSeconds: o.seconds,
      send: async () => {
        const long = nextIsLong()
        const body = { model: 'handoff/sim-1', prompt: `a ${long ? 'long' : 'short'} answer, please`, max_tokens: long ? o.longTokens : o.shortTokens, ignore_eos: true }
        const t0 = performance.now()
        const res = await request(`${router.url}/v1/completions`, { method: 'POST', dispatcher: agent, body: JSON.stringify(body), headers: { 'content-type': 'application/json' }, headersTimeout: 120_000, bodyTimeout: 120_000 })
        await res.body.text()
        if (res.statusCode !== 200) return void errors++
        ok++
        ;(long ? latencies.long : latencies.short).push(performance.now() - t0)
      },
    })
    const after = await metrics()
    const delta = (name: string): number => counter(after, name) - counter(before, name)
    const p99 = (xs: number[]): number => percentile([...xs].sort((a, b) => a - b), 99)
    return {
      ok,
      errors: errors + load.errors,
      reqPerS: ok / load.wallSeconds,
      whole: delta('handoff_router_whole_answer_reads_total'),
      unproven: delta('handoff_router_unproven_reads_total'),
      late: delta('handoff_router_late_reads_total'),
      shortP99: p99(latencies.short),
      longP99: p99(latencies.long),
    }
  } finally {
    await agent.close()
    await cluster.stop()
  }
}

export async function runMixedWorkload(o: MixedOptions): Promise<void> {
  const ms = (x: number): string => (Number.isFinite(x) ? `${Math.round(x)}` : '–')
  process.stdout.write(
    [
      `Machine: ${cpus().length} × ${cpus()[0]?.model ?? 'cpu'}, ${(totalmem() / 2 ** 30).toFixed(0)} GiB, Node ${process.version}. 1 P + 1 D simulator (--kv none), D decoding ${o.decodeDelayMs} ms/token with --max-num-seqs ${o.maxNumSeqs}; ${o.concurrency} clients in a closed loop of non-streamed /v1/completions for ${o.seconds} s per cell, each request ${o.shortTokens} or ${o.longTokens} tokens (ignore_eos) drawn at the long share; the router checks every read (no agents), a fresh cluster per cell.`,
      '',
      `${o.baseline ? `Baseline: ${o.baseline}.\n\n` : ''}| lease s | long share | router | 200s | req/s | whole-answer proof | unproven (prefilled again) | late | short p99 ms | long p99 ms |`,
      '| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |',
      '',
    ].join('\n'),
  )
  const builds: { name: string; entry?: string }[] = [{ name: 'this build' }, ...(o.baseline ? [{ name: 'baseline', entry: o.baseline }] : [])]
  let i = 0
  for (const leaseSeconds of o.leaseSeconds) {
    for (const longShare of o.longShares) {
      // In turn, the first one alternating: neither always gets the cooler machine.
      for (const b of i++ % 2 === 0 ? builds : [...builds].reverse()) {
        const r = await cell(o, longShare, leaseSeconds, b.entry)
        const share = r.ok > 0 ? `${r.whole} (${((100 * r.whole) / r.ok).toFixed(0)} %)` : '0'
        process.stdout.write(
          `| ${leaseSeconds} | ${(100 * longShare).toFixed(0)} % | ${b.name} | ${r.ok}${r.errors ? ` (+${r.errors} failed)` : ''} | ${r.reqPerS.toFixed(1)} | ${share} | ${r.unproven} | ${r.late} | ${ms(r.shortP99)} | ${ms(r.longP99)} |\n`,
        )
      }
    }
  }
}
