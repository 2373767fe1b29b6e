import { cpus, totalmem } from 'node:os'
import { parseArgs } from 'node:util'
import { Agent, request } from 'undici'
import { spawnService } from '../common/spawn.js'
import { startBenchCluster } from './cluster.js'
import { decodeBody, prefillBody } from '../router/src/proxy/legs.js'
import { closedLoop, emptyLoad, mean, mergeLoads, percentile, positiveList, type LoadResult } from './load.js'
import { runOverload } from './overload.js'
import { runMixedWorkload } from './overhead-mixed.js'
import { cpuSeconds, rssMiB } from './proc-stats.js'
import { startVllmRouter, vllmRouterBin, type ExternalRouter } from './vllm-router.js'

const HELP = `usage: handoff bench overhead [--quick] [--sizes 200,2048,16384,204800]
                               [--concurrency 1,64] [--seconds S] [--requests N] [--rounds R]
                               [--warmup S] [--json]
                               [--no-overload | --overload-only] [--overload-concurrency 300]
                               [--overload-seconds 25] [--overload-tokens 100] [--overload-ramp S]
                               [--baseline PATH/dist/handoff.js]
                               [--vllm-router PATH | --no-vllm-router]
       handoff bench overhead --mixed [--concurrency 64] [--seconds 20] [--long-share 0,0.1,0.5,1]
                               [--lease 30,10] [--short-tokens 16] [--long-tokens 512]
                               [--decode-delay-ms 10] [--max-num-seqs 32] [--baseline PATH]

Router overhead: the same simulators (--kv none, zero delays) driven three ways, alternating
in one run: a direct two-leg client, a bare fastify+undici two-leg proxy (the floor of the
stack), and the router. Prints a markdown table. --baseline adds a path, the router of
another build (an earlier commit's checkout), so a change is compared in the same run.
Before the measured rounds of each cell, every path runs the cell's load for --warmup seconds
(default 3): a router that just started is still compiling its hot paths, and its first
second under load had every request of its p99 (a long-lived router's steady state is what
is compared; vLLM Router, compiled ahead, is warmed the same).
vLLM Router (PyPI vllm-router, installed by scripts/vllm-router.sh in .cache/vllm-router/, or
the binary --vllm-router names) runs as one more path when it is there, with the ratios of
req/s and p99 against it.

Then the overload case: a slow decoder (40 ms/token) under hundreds of concurrent streams,
a direct client beside the router: non-2xx counts, the decoder's state as the router saw it,
goodput and p99. Clients start over --overload-ramp seconds (default: one request's decode
time, so streams do not run in lockstep waves; 0: all at once); goodput counts the 200s that
finished after the ramp.

--mixed, instead (issue 37 item 4): a mixed workload, short and long max_tokens drawn at each
--long-share, with queueing at the decoder (--max-num-seqs below --concurrency), under each
--lease (leaseSeconds): how many checked reads were proven by D's whole answer
(leases.proveByWholeAnswer), how many missed the window and were prefilled again, req/s and
p99 per kind. A fresh cluster per cell; --baseline runs another build's router beside it.
`

const WORDS = ['alpha', 'bravo', 'charlie', 'delta', 'echo', 'foxtrot', 'golf', 'hotel', 'india', 'juliet']

/** A prompt of about `bytes` bytes of words. */
export function promptOfSize(bytes: number): string {
  const parts: string[] = []
  let len = 0
  for (let i = 0; len < bytes; i++) {
    const w = WORDS[(i * 7) % WORDS.length] as string
    parts.push(w)
    len += w.length + 1
  }
  return parts.join(' ').slice(0, bytes)
}

interface Cell {
  size: number
  concurrency: number
  direct: LoadResult
  bare: LoadResult
  router: LoadResult
  /** The --baseline build's router, when given. */
  baseline: LoadResult | undefined
  baselineCpuPer1k: number
  /** vLLM Router over the same pair, when installed. */
  vllmRouter: LoadResult | undefined
  vllmRouterCpuPer1k: number
  bareCpuPer1k: number
  routerCpuPer1k: number
  /** P and D together, over the same router rounds: the work the router fronts. */
  enginesCpuPer1k: number
  routerRssMiB: number
}

export async function runOverheadBench(argv: string[]): Promise<void> {
  const { values } = parseArgs({
    args: argv,
    options: {
      quick: { type: 'boolean' },
      sizes: { type: 'string' },
      concurrency: { type: 'string' },
      seconds: { type: 'string' },
      requests: { type: 'string' },
      rounds: { type: 'string' },
      warmup: { type: 'string' },
      json: { type: 'boolean' },
      'no-overload': { type: 'boolean' },
      'overload-only': { type: 'boolean' },
      'overload-concurrency': { type: 'string' },
      'overload-seconds': { type: 'string' },
      'overload-tokens': { type: 'string' },
      'overload-ramp': { type: 'string' },
      baseline: { type: 'string' },
      'vllm-router': { type: 'string' },
      'no-vllm-router': { type: 'boolean' },
      mixed: { type: 'boolean' },
      'long-share': { type: 'string' },
      lease: { type: 'string' },
      'short-tokens': { type: 'string' },
      'long-tokens': { type: 'string' },
      'decode-delay-ms': { type: 'string' },
      'max-num-seqs': { type: 'string' },
      help: { type: 'boolean', short: 'h' },
    },
  })
  if (values.help) {
    process.stdout.write(HELP)
    return
  }
  if (values.mixed) {
    const shares = (values['long-share'] ?? '0,0.1,0.5,1').split(',').map(Number)
    if (shares.some((x) => !(x >= 0 && x <= 1))) throw new Error(`bad --long-share '${values['long-share']}' (shares between 0 and 1)`)
    const one = (v: string | undefined, fallback: number, name: string): number => {
      const n = Number(v ?? fallback)
      if (!(n > 0)) throw new Error(`bad --${name} '${v}'`)
      return n
    }
    return runMixedWorkload({
      concurrency: one(values.concurrency, 64, 'concurrency'),
      seconds: one(values.seconds, 20, 'seconds'),
      shortTokens: one(values['short-tokens'], 16, 'short-tokens'),
      longTokens: one(values['long-tokens'], 512, 'long-tokens'),
      longShares: shares,
      leaseSeconds: positiveList(values.lease, [30, 10]),
      decodeDelayMs: one(values['decode-delay-ms'], 10, 'decode-delay-ms'),
      maxNumSeqs: one(values['max-num-seqs'], 32, 'max-num-seqs'),
      baseline: values.baseline,
    })
  }
  const quick = values.quick === true
  const sizes = positiveList(values.sizes, quick ? [200, 2048] : [200, 2048, 16384, 204800])
  const concurrencies = positiveList(values.concurrency, quick ? [1, 8] : [1, 64])
  const seconds = Number(values.seconds ?? (quick ? 1 : 4))
  const maxRequests = Number(values.requests ?? (quick ? 200 : 4000))
  const rounds = Number(values.rounds ?? (quick ? 1 : 2))
  const warmupSeconds = Number(values.warmup ?? (quick ? 0.5 : 3))
  if (!(warmupSeconds >= 0)) throw new Error(`bad --warmup '${values.warmup}'`)
  const overload = {
    concurrency: Number(values['overload-concurrency'] ?? (quick ? 60 : 300)),
    seconds: Number(values['overload-seconds'] ?? (quick ? 4 : 25)),
    maxTokens: Number(values['overload-tokens'] ?? (quick ? 20 : 100)),
    decodeDelayMs: 40,
    rampSeconds: values['overload-ramp'] === undefined ? undefined : Number(values['overload-ramp']),
  }
  const vllmRouter = values['no-vllm-router'] ? undefined : vllmRouterBin(values['vllm-router'])
  if (!vllmRouter && !values['no-vllm-router']) process.stderr.write('vLLM Router is not installed (scripts/vllm-router.sh): no anchor in this run\n')
  if (!values['overload-only']) await runOverheadTable({ sizes, concurrencies, seconds, maxRequests, rounds, warmupSeconds, json: values.json === true, baseline: values.baseline, vllmRouter })
  if (!values['no-overload']) process.stdout.write(await runOverload({ ...overload, baseline: values.baseline, vllmRouter }))
}

async function runOverheadTable(o: {
  sizes: number[]
  concurrencies: number[]
  seconds: number
  maxRequests: number
  rounds: number
  warmupSeconds: number
  json: boolean
  baseline: string | undefined
  vllmRouter: string | undefined
}): Promise<void> {
  const { sizes, concurrencies, seconds, maxRequests, rounds, warmupSeconds } = o
  const values = { json: o.json }

  const agent = new Agent({ connections: 256, keepAliveTimeout: 30_000 })
  const cluster = await startBenchCluster()
  let anchor: ExternalRouter | undefined
  try {
    const { p, d } = cluster
    anchor = o.vllmRouter ? await startVllmRouter(o.vllmRouter, p.url, d.url) : undefined
    const router = await cluster.router()
    const routerPid = router.child.pid as number
    const baselineRouter = o.baseline ? await cluster.router(o.baseline) : undefined
    const bare = cluster.own(await spawnService({ args: ['bench', 'bare-proxy', '--prefill', p.url, '--decode', d.url] }))
    const barePid = bare.child.pid as number

    const post = async (url: string, body: unknown): Promise<Record<string, unknown>> => {
      const res = await request(url, { method: 'POST', dispatcher: agent, body: JSON.stringify(body), headers: { 'content-type': 'application/json' } })
      const json = (await res.body.json()) as Record<string, unknown>
      if (res.statusCode !== 200) throw new Error(`HTTP ${res.statusCode}`)
      return json
    }
    const cells: Cell[] = []
    for (const size of sizes) {
      const body = { model: 'handoff/sim-1', prompt: promptOfSize(size), max_tokens: 8 }
      // The direct client does what the router does, minus the router: two legs, params verbatim.
      const direct = async (): Promise<void> => {
        const pr = await post(`${p.url}/v1/completions`, prefillBody(body))
        await post(`${d.url}/v1/completions`, decodeBody(body, pr.kv_transfer_params as Record<string, unknown>))
      }
      const viaRouter = async (): Promise<void> => {
        await post(`${router.url}/v1/completions`, body)
      }
      const viaBaseline = async (): Promise<void> => {
        await post(`${baselineRouter?.url}/v1/completions`, body)
      }
      const viaBare = async (): Promise<void> => {
        await post(`${bare.url}/v1/completions`, body)
      }
      const viaAnchor = async (): Promise<void> => {
        await post(`${anchor?.url}/v1/completions`, body)
      }
      for (const concurrency of concurrencies) {
        const loop = { concurrency, maxRequests, maxSeconds: seconds }
        // Warm every path (connections, JIT) at this cell's load before measuring: 50 requests
        // left a fresh router compiling through its first measured second.
        for (const send of [direct, viaRouter, viaBare, ...(baselineRouter ? [viaBaseline] : []), ...(anchor ? [viaAnchor] : [])]) {
          await closedLoop({ ...loop, maxSeconds: warmupSeconds, send })
        }
        // One measured loop, with the CPU the given processes spent during it.
        const cpuOf = (pids: number[]): number => pids.reduce((sum, pid) => sum + cpuSeconds(pid), 0)
        const measure = async (send: () => Promise<void>, pids: number[]): Promise<{ load: LoadResult; cpu: number }> => {
          const before = cpuOf(pids)
          const load = await closedLoop({ ...loop, send })
          return { load, cpu: cpuOf(pids) - before }
        }
        const enginePids = [p.child.pid as number, d.child.pid as number]
        const empty = emptyLoad
        let d0 = empty()
        let r0 = empty()
        let base0 = empty()
        let baselineCpu = 0
        let a0 = empty()
        let anchorCpu = 0
        let b0 = empty()
        let cpu = 0
        let bareCpu = 0
        let enginesCpu = 0
        for (let r = 0; r < rounds; r++) {
          d0 = mergeLoads(d0, (await measure(direct, [])).load)
          const b = await measure(viaBare, [barePid])
          b0 = mergeLoads(b0, b.load)
          bareCpu += b.cpu
          // Router and engines over the same loop: separate readings of one measurement.
          const before = cpuOf(enginePids)
          const rt = await measure(viaRouter, [routerPid])
          r0 = mergeLoads(r0, rt.load)
          cpu += rt.cpu
          enginesCpu += cpuOf(enginePids) - before
          if (baselineRouter) {
            const bl = await measure(viaBaseline, [baselineRouter.child.pid as number])
            base0 = mergeLoads(base0, bl.load)
            baselineCpu += bl.cpu
          }
          if (anchor) {
            const an = await measure(viaAnchor, [anchor.pid])
            a0 = mergeLoads(a0, an.load)
            anchorCpu += an.cpu
          }
        }
        const cell: Cell = {
          size,
          concurrency,
          direct: d0,
          bare: b0,
          router: r0,
          baseline: baselineRouter ? base0 : undefined,
          baselineCpuPer1k: (baselineCpu / Math.max(1, base0.latenciesMs.length)) * 1000,
          vllmRouter: anchor ? a0 : undefined,
          vllmRouterCpuPer1k: (anchorCpu / Math.max(1, a0.latenciesMs.length)) * 1000,
          bareCpuPer1k: (bareCpu / Math.max(1, b0.latenciesMs.length)) * 1000,
          routerCpuPer1k: (cpu / Math.max(1, r0.latenciesMs.length)) * 1000,
          enginesCpuPer1k: (enginesCpu / Math.max(1, r0.latenciesMs.length)) * 1000,
          routerRssMiB: rssMiB(routerPid),
        }
        cells.push(cell)
        if (values.json) process.stdout.write(JSON.stringify(summarize(cell)) + '\n')
        else process.stderr.write(`measured size=${size} c=${concurrency}\n`)
      }
    }
    if (!values.json) process.stdout.write(table(cells, { seconds, maxRequests, rounds, warmupSeconds }))
  } finally {
    await anchor?.stop()
    await cluster.stop()
    await agent.close()
  }
}

function summarize(c: Cell) {
  const ds = [...c.direct.latenciesMs].sort((a, b) => a - b)
  const rs = [...c.router.latenciesMs].sort((a, b) => a - b)
  const bs = [...c.bare.latenciesMs].sort((a, b) => a - b)
  const vs = c.vllmRouter ? [...c.vllmRouter.latenciesMs].sort((a, b) => a - b) : undefined
  const routerRps = rs.length / c.router.wallSeconds
  return {
    prompt_bytes: c.size,
    concurrency: c.concurrency,
    direct_p50_ms: percentile(ds, 50),
    direct_p99_ms: percentile(ds, 99),
    direct_p999_ms: percentile(ds, 99.9),
    direct_rps: ds.length / c.direct.wallSeconds,
    router_p50_ms: percentile(rs, 50),
    router_p99_ms: percentile(rs, 99),
    router_p999_ms: percentile(rs, 99.9),
    router_rps: routerRps,
    ...(vs && c.vllmRouter
      ? {
          vllm_router_p50_ms: percentile(vs, 50),
          vllm_router_p99_ms: percentile(vs, 99),
          vllm_router_p999_ms: percentile(vs, 99.9),
          vllm_router_rps: vs.length / c.vllmRouter.wallSeconds,
          vllm_router_cpu_s_per_1k: c.vllmRouterCpuPer1k,
          // The issue 23 ratios: handoff's req/s over vLLM Router's (higher is better), its p99 over theirs (lower is better).
          rps_vs_vllm_router: routerRps / (vs.length / c.vllmRouter.wallSeconds),
          p99_vs_vllm_router: percentile(rs, 99) / percentile(vs, 99),
        }
      : {}),
    bare_p50_ms: percentile(bs, 50),
    bare_rps: bs.length / c.bare.wallSeconds,
    added_mean_ms: mean(rs) - mean(ds),
    ...(c.baseline
      ? { baseline_added_mean_ms: mean(c.baseline.latenciesMs) - mean(ds), baseline_rps: c.baseline.latenciesMs.length / c.baseline.wallSeconds, baseline_cpu_s_per_1k: c.baselineCpuPer1k }
      : {}),
    bare_added_mean_ms: mean(bs) - mean(ds),
    bare_cpu_s_per_1k: c.bareCpuPer1k,
    router_cpu_s_per_1k: c.routerCpuPer1k,
    engines_cpu_s_per_1k: c.enginesCpuPer1k,
    router_rss_mib: c.routerRssMiB,
    errors: c.direct.errors + c.router.errors + c.bare.errors + (c.vllmRouter?.errors ?? 0),
  }
}

function table(cells: Cell[], run: { seconds: number; maxRequests: number; rounds: number; warmupSeconds: number }): string {
  const f = (n: number | undefined, d = 2): string => (n !== undefined && Number.isFinite(n) ? n.toFixed(d) : 'n/a')
  const rows = cells.map((c) => {
    const s = summarize(c)
    const anchor = s.vllm_router_rps === undefined ? '' : ` ${f(s.vllm_router_p50_ms)} / ${f(s.vllm_router_p99_ms)} / ${f(s.vllm_router_p999_ms)} | ${f(s.vllm_router_rps, 0)} | ${f(s.rps_vs_vllm_router)}x / ${f(s.p99_vs_vllm_router)}x |`
    return `| ${s.prompt_bytes} | ${s.concurrency} | ${f(s.direct_p50_ms)} / ${f(s.direct_p99_ms)} / ${f(s.direct_p999_ms)} | ${f(s.router_p50_ms)} / ${f(s.router_p99_ms)} / ${f(s.router_p999_ms)} | ${f(s.direct_rps, 0)} / ${f(s.bare_rps, 0)} / ${f(s.router_rps, 0)} | ${f(s.bare_added_mean_ms)} / ${f(s.added_mean_ms)}${s.baseline_added_mean_ms === undefined ? '' : ` / ${f(s.baseline_added_mean_ms)}`} | ${f(s.bare_cpu_s_per_1k)} / ${f(s.router_cpu_s_per_1k)}${s.baseline_cpu_s_per_1k === undefined ? '' : ` / ${f(s.baseline_cpu_s_per_1k)}`} | ${f(s.engines_cpu_s_per_1k)} | ${f(s.router_rss_mib, 0)} | ${s.errors} |${anchor}`
  })
  const anchored = cells.some((c) => c.vllmRouter)
  return [
    `Machine: ${cpus().length} × ${cpus()[0]?.model ?? 'cpu'}, ${(totalmem() / 2 ** 30).toFixed(0)} GiB, Node ${process.version}; ${run.warmupSeconds} s of warm-up per path, then ${run.rounds} alternating rounds of ≤${run.maxRequests} requests / ${run.seconds} s per path per cell; /v1/completions, max_tokens 8, not streamed.`,
    '',
    `| prompt bytes | concurrency | direct p50 / p99 / p99.9 ms | router p50 / p99 / p99.9 ms | req/s direct / bare / router | added mean ms bare / router${cells.some((c) => c.baseline) ? ' / baseline' : ''} | proxy CPU s per 1k req bare / router${cells.some((c) => c.baseline) ? ' / baseline' : ''} | P+D CPU s per 1k req | router RSS MiB | errors |${anchored ? ' vLLM Router p50 / p99 / p99.9 ms | vLLM Router req/s | router ÷ vLLM Router: req/s / p99 |' : ''}`,
    `| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |${anchored ? ' ---: | ---: | ---: |' : ''}`,
    ...rows,
    '',
  ].join('\n')
}
