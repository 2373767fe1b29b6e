import { execFile } from 'node:child_process'
import { mkdtemp, rm, writeFile } from 'node:fs/promises'
import { cpus, tmpdir, totalmem } from 'node:os'
import { join } from 'node:path'
import { parseArgs, promisify } from 'node:util'
import { Agent, request } from 'undici'
import { startBenchCluster } from './cluster.js'
import { closedLoop } from './load.js'

const run = promisify(execFile)

const HELP = `usage: handoff bench overload [--runs N] [--keep-going] [--concurrency N] [--seconds S] [--tokens N] [--client wrk|undici] [--stream] [--health-delay-ms MS] [--baseline PATH/dist/cli/main.js]

Issue 37 item 5: 1 P + 1 D simulator (decode 40 ms/token), a router process at log level warn,
--concurrency (300) clients in a closed loop of chats of --tokens (100) for --seconds (20),
a fresh cluster per run. Each run prints its statuses and what the router did to the decoder
(samples of instance_up every 500 ms, ejections, failures excused as busy). Stops at the first
run that marked the decoder down unless --keep-going; exits 1 if any did. --client wrk (the
default when Debian's wrk is installed) sends non-streamed requests as the issue did.
--health-delay-ms: the decoder's /health answers that late, as vLLM's does behind its API
server's output loop under load (vllm-project/vllm#38157: 30-40 s); the router's probes time
out after 2 s. --baseline: each run also serves the same load through another build's router
(its own fresh cluster), the two in turn, so the two are compared on one machine in one run.
`

interface RunResult {
  statuses: Map<string, number>
  samples: number
  downSamples: number
  ejections: number
  excusedProbes: number
  excusedConnects: number
}

function metric(text: string, re: RegExp): number {
  return [...text.matchAll(re)].reduce((a, m) => a + Number(m[1]), 0)
}

async function hasWrk(): Promise<boolean> {
  return run('wrk', ['--version']).then(
    () => true,
    (err: { code?: unknown; stdout?: string }) => err.code !== 'ENOENT' && /wrk/.test(String(err.stdout ?? '')),
  )
}

/** wrk with a script that posts the body and prints one `status N COUNT` line per status. */
async function wrkLoad(url: string, body: unknown, o: { concurrency: number; seconds: number }): Promise<Map<string, number>> {
  const dir = await mkdtemp(join(tmpdir(), 'handoff-overload-'))
  try {
    const script = join(dir, 'post.lua')
    await writeFile(
      script,
      `wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = ${JSON.stringify(JSON.stringify(body))}
local threads = {}
function setup(thread) table.insert(threads, thread) end
function init(args) statuses = {} end
function response(status, headers, body) statuses[status] = (statuses[status] or 0) + 1 end
function done(summary, latency, requests)
  local all = {}
  for _, t in ipairs(threads) do
    for k, v in pairs(t:get("statuses")) do all[k] = (all[k] or 0) + v end
  end
  for k, v in pairs(all) do io.write(string.format("status %d %d\\n", k, v)) end
  io.write(string.format("errors %d\\n", summary.errors.connect + summary.errors.read + summary.errors.write + summary.errors.timeout))
end
`,
    )
    const { stdout } = await run('wrk', ['-t2', `-c${o.concurrency}`, `-d${o.seconds}s`, '--timeout', '60s', '-s', script, `${url}/v1/chat/completions`], { maxBuffer: 1 << 20 })
    const statuses = new Map<string, number>()
    for (const m of stdout.matchAll(/^status (\d+) (\d+)$/gm)) statuses.set(m[1]!, Number(m[2]))
    const errors = Number(/^errors (\d+)$/m.exec(stdout)?.[1] ?? 0)
    if (errors > 0) statuses.set('transport error', errors)
    return statuses
  } finally {
    await rm(dir, { recursive: true, force: true })
  }
}

async function undiciLoad(url: string, body: unknown, o: { concurrency: number; seconds: number }): Promise<Map<string, number>> {
  const agent = new Agent({ connections: o.concurrency, keepAliveTimeout: 4000 })
  const statuses = new Map<string, number>()
  const count = (k: string): void => void statuses.set(k, (statuses.get(k) ?? 0) + 1)
  try {
    await closedLoop({
      concurrency: o.concurrency,
      maxRequests: Number.MAX_SAFE_INTEGER,
      maxSeconds: o.seconds,
      send: async () => {
        try {
          const res = await request(`${url}/v1/chat/completions`, { method: 'POST', dispatcher: agent, body: JSON.stringify(body), headers: { 'content-type': 'application/json' }, headersTimeout: 60_000, bodyTimeout: 60_000 })
          await res.body.text()
          count(String(res.statusCode))
        } catch {
          count('transport error')
        }
      },
    })
    return statuses
  } finally {
    await agent.close()
  }
}

interface RunOptions {
  concurrency: number
  seconds: number
  tokens: number
  client: 'wrk' | 'undici'
  stream: boolean
  healthDelayMs: number
}

async function oneRun(o: RunOptions, entry?: string): Promise<RunResult> {
  const cluster = await startBenchCluster({ decodeDelayMs: 40 })
  const agent = new Agent({ connections: 2 })
  try {
    const router = await cluster.router(entry)
    if (o.healthDelayMs > 0) {
      // Probed up first, as a decoder is before the load comes; then its /health falls behind.
      const upBy = performance.now() + 15_000
      const up = async (): Promise<boolean> => /^handoff_router_instance_up\{[^}]*instance="d0"[^}]*\} 1/m.test(await (await request(`${router.url}/metrics`, { dispatcher: agent })).body.text())
      while (!(await up())) {
        if (performance.now() > upBy) throw new Error('the decoder was not probed up within 15 s')
        await new Promise((r) => setTimeout(r, 100))
      }
      const set = await request(`${cluster.d.url}/sim/faults`, { method: 'POST', dispatcher: agent, body: JSON.stringify({ healthDelayMs: o.healthDelayMs }), headers: { 'content-type': 'application/json' } })
      await set.body.text()
      if (set.statusCode !== 200) throw new Error(`the decoder refused the /health delay: ${set.statusCode}`)
    }
    const body = { model: 'handoff/sim-1', messages: [{ role: 'user', content: 'tell me a long story' }], max_tokens: o.tokens, ...(o.stream ? { stream: true } : {}) }
    let samples = 0
    let downSamples = 0
    const sampler = setInterval(() => {
      void request(`${router.url}/metrics`, { dispatcher: agent })
        .then((r) => r.body.text())
        .then((text) => {
          samples++
          if (/^handoff_router_instance_up\{[^}]*instance="d0"[^}]*\} 0/m.test(text)) downSamples++
        })
        .catch(() => undefined)
    }, 500)
    const statuses = o.client === 'wrk' ? await wrkLoad(router.url, body, o) : await undiciLoad(router.url, body, o)
    clearInterval(sampler)
    const text = await (await request(`${router.url}/metrics`, { dispatcher: agent })).body.text()
    return {
      statuses,
      samples,
      downSamples,
      ejections: metric(text, /^handoff_router_topology_changes_total\{type="ejected"\} (\d+)/gm),
      excusedProbes: metric(text, /^handoff_router_health_failures_excused_total\{check="probe"\} (\d+)/gm),
      excusedConnects: metric(text, /^handoff_router_health_failures_excused_total\{check="connect"\} (\d+)/gm),
    }
  } finally {
    await agent.close()
    await cluster.stop()
  }
}

export async function runOverloadRunsBench(argv: string[]): Promise<void> {
  const { values } = parseArgs({
    args: argv,
    options: {
      runs: { type: 'string' },
      'keep-going': { type: 'boolean' },
      concurrency: { type: 'string' },
      seconds: { type: 'string' },
      tokens: { type: 'string' },
      client: { type: 'string' },
      stream: { type: 'boolean' },
      'health-delay-ms': { type: 'string' },
      baseline: { type: 'string' },
      help: { type: 'boolean', short: 'h' },
    },
  })
  if (values.help) return void process.stdout.write(HELP)
  const num = (v: string | undefined, fallback: number, name: string): number => {
    const n = Number(v ?? fallback)
    if (!Number.isInteger(n) || n < 1) throw new Error(`bad --${name} '${v}'`)
    return n
  }
  const runs = num(values.runs, 10, 'runs')
  const healthDelayMs = Number(values['health-delay-ms'] ?? 0)
  if (!Number.isInteger(healthDelayMs) || healthDelayMs < 0) throw new Error(`bad --health-delay-ms '${values['health-delay-ms']}'`)
  const o = { concurrency: num(values.concurrency, 300, 'concurrency'), seconds: num(values.seconds, 20, 'seconds'), tokens: num(values.tokens, 100, 'tokens'), stream: values.stream === true, healthDelayMs }
  if (values.client !== undefined && values.client !== 'wrk' && values.client !== 'undici') throw new Error(`bad --client '${values.client}' (wrk or undici)`)
  const client = (values.client as 'wrk' | 'undici' | undefined) ?? ((await hasWrk()) && !o.stream ? 'wrk' : 'undici')
  if (client === 'wrk' && o.stream) throw new Error('--client wrk sends non-streamed requests; use --client undici with --stream')
  process.stdout.write(
    [
      `Machine: ${cpus().length} × ${cpus()[0]?.model ?? 'cpu'}, ${(totalmem() / 2 ** 30).toFixed(0)} GiB, Node ${process.version}. 1 P + 1 D simulator (--kv none), decode 40 ms/token${o.healthDelayMs > 0 ? `, its /health answering ${o.healthDelayMs} ms late once probed up` : ''}; router at log level warn with default config; ${o.concurrency} ${o.stream ? 'streamed' : 'non-streamed'} chats of ${o.tokens} tokens in a closed loop (${client}) for ${o.seconds} s, a fresh cluster per run.`,
      '',
      `${values.baseline ? `Baseline: ${values.baseline}.\n\n` : ''}| run | router | statuses | decoder down (samples) | ejections | excused probes / connects |`,
      '| ---: | --- | --- | ---: | ---: | ---: |',
      '',
    ].join('\n'),
  )
  const builds: { name: string; entry?: string }[] = [{ name: 'this build' }, ...(values.baseline ? [{ name: 'baseline', entry: values.baseline }] : [])]
  const marked = new Map(builds.map((b) => [b.name, 0]))
  let done = 0
  for (let i = 1; i <= runs; i++) {
    // In turn, the first one alternating: neither always gets the cooler machine.
    for (const b of i % 2 === 1 ? builds : [...builds].reverse()) {
      const r = await oneRun({ ...o, client }, b.entry)
      const statuses = [...r.statuses].map(([k, n]) => `${n} × ${k}`).join(', ') || 'none'
      process.stdout.write(`| ${i} | ${b.name} | ${statuses} | ${r.downSamples}/${r.samples} | ${r.ejections} | ${r.excusedProbes} / ${r.excusedConnects} |\n`)
      if (r.downSamples > 0 || r.ejections > 0) marked.set(b.name, marked.get(b.name)! + 1)
    }
    done = i
    if (marked.get('this build')! > 0 && !values['keep-going']) break
  }
  process.stdout.write('\n')
  for (const [name, n] of marked) process.stdout.write(`${name}: ${n} of ${done} runs marked the decoder down or ejected it.\n`)
  if (marked.get('this build')! > 0) process.exitCode = 1
}
