import { parseArgs } from 'node:util'
import { cpus } from 'node:os'
import { Agent, request } from 'undici'
import { startBenchCluster } from './cluster.js'
import { closedLoop, percentile } from './load.js'
import { promptOfSize } from './overhead.js'
import { cpuSeconds } from './proc-stats.js'

const USAGE = `usage: handoff bench paired --baseline PATH/dist/handoff.js [--baseline-node PATH/bin/node] [--size BYTES] [--concurrency N] [--rounds N] [--seconds S]

This build's router and another build's serve the same two simulators at the same time, the
requests of one closed loop alternating between them, so both see the same machine at every
instant: each round gives the ratio of their CPU per request (and their latencies). On a
noisy VM that ratio varies by about ±2 % between rounds (two copies of one build), where runs
one after another drift by ±30 %. Use it to judge a change to the request path.

--baseline-node runs the baseline under another Node binary: with --baseline this build's
own dist/handoff.js, it compares runtimes (the one running this command against that one).`

interface Side {
  pid: number
  url: string
  latenciesMs: number[]
  done: number
  errors: number
}

export async function runPairedBench(argv: string[]): Promise<void> {
  const { values } = parseArgs({
    args: argv,
    options: {
      baseline: { type: 'string' },
      'baseline-node': { type: 'string' },
      size: { type: 'string' },
      concurrency: { type: 'string' },
      rounds: { type: 'string' },
      seconds: { type: 'string' },
      help: { type: 'boolean' },
    },
  })
  if (values.help || !values.baseline) {
    process.stdout.write(`${USAGE}\n`)
    if (!values.help) process.exitCode = 2
    return
  }
  const size = Number(values.size ?? 2048)
  const concurrency = Number(values.concurrency ?? 64)
  const rounds = Number(values.rounds ?? 3)
  const seconds = Number(values.seconds ?? 8)
  const body = JSON.stringify({ model: 'handoff/sim-1', prompt: promptOfSize(size), max_tokens: 8 })
  const agent = new Agent({ connections: 256, keepAliveTimeout: 30_000 })
  const cluster = await startBenchCluster()
  try {
    const [mine, base] = await Promise.all([cluster.router(), cluster.router(values.baseline, values['baseline-node'])])
    // The baseline first, this build second: the columns of each row.
    const sides: Side[] = [
      { pid: base.child.pid as number, url: base.url, latenciesMs: [], done: 0, errors: 0 },
      { pid: mine.child.pid as number, url: mine.url, latenciesMs: [], done: 0, errors: 0 },
    ]
    let next = 0
    const send = async (): Promise<void> => {
      const side = sides[next++ % sides.length] as Side
      const t0 = performance.now()
      try {
        const res = await request(`${side.url}/v1/completions`, { method: 'POST', dispatcher: agent, body, headers: { 'content-type': 'application/json' } })
        await res.body.arrayBuffer()
        if (res.statusCode !== 200) throw new Error(`status ${res.statusCode}`)
        side.latenciesMs.push(performance.now() - t0)
        side.done++
      } catch {
        side.errors++
      }
    }
    const loop = (s: number) => closedLoop({ concurrency, maxRequests: Number.MAX_SAFE_INTEGER, maxSeconds: s, send })
    await loop(2) // warm-up: connections, JIT
    const rows: string[] = []
    for (let round = 1; round <= rounds; round++) {
      for (const side of sides) Object.assign(side, { latenciesMs: [], done: 0, errors: 0 })
      const before = sides.map((s) => cpuSeconds(s.pid))
      await loop(seconds)
      const ms = sides.map((s, i) => ((cpuSeconds(s.pid) - (before[i] as number)) * 1000) / Math.max(1, s.done))
      const lat = sides.map((s) => {
        const sorted = [...s.latenciesMs].sort((a, b) => a - b)
        return `${percentile(sorted, 50).toFixed(1)} / ${percentile(sorted, 99).toFixed(1)} / ${percentile(sorted, 99.9).toFixed(1)}`
      })
      const [b, m] = ms as [number, number]
      rows.push(`| ${round} | ${b.toFixed(3)} | ${m.toFixed(3)} | ${(m / b).toFixed(3)} | ${lat[0]} | ${lat[1]} | ${sides.map((s) => s.done).join(' / ')} | ${sides.map((s) => s.errors).join(' / ')} |`)
      process.stderr.write(`round ${round}: CPU ms per request ${b.toFixed(3)} → ${m.toFixed(3)}\n`)
    }
    process.stdout.write(
      [
        `Machine: ${cpus().length} × ${cpus()[0]?.model ?? 'cpu'}, Node ${process.version}; /v1/completions, ${size} B prompt, max_tokens 8, not streamed; concurrency ${concurrency} in all, alternating; ${rounds} rounds of ${seconds} s; baseline ${values.baseline}${values['baseline-node'] ? ` on ${values['baseline-node']}` : ''}.`,
        '',
        '| round | CPU ms per request, baseline | this build | this ÷ baseline | baseline p50 / p99 / p99.9 ms | this build p50 / p99 / p99.9 ms | requests | errors |',
        '| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |',
        ...rows,
        '',
      ].join('\n'),
    )
  } finally {
    await cluster.stop()
    await agent.close()
  }
}
