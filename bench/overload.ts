import { cpus, totalmem } from 'node:os'
import { Agent, request } from 'undici'
import { startBenchCluster } from './cluster.js'
import { decodeBody, prefillBody } from '../router/src/proxy/legs.js'
import { closedLoop, mean, percentile, type LoadResult } from './load.js'
import { startVllmRouter } from './vllm-router.js'

export interface OverloadOptions {
  concurrency: number
  seconds: number
  maxTokens: number
  decodeDelayMs: number
  /** Seconds over which the clients start (default: one request's decode time; 0: all at once). */
  rampSeconds?: number | undefined
  /** Another build's CLI entry: its router runs the same load as a third row. */
  baseline?: string | undefined
  /** vLLM Router's binary: it runs the same load as one more row, the anchor of the ratios. */
  vllmRouter?: string | undefined
}

interface Row {
  path: 'direct' | 'router' | 'baseline router' | 'vLLM Router'
  load: LoadResult
  statuses: Map<number, number>
  /** Why requests failed: `HTTP <status>` or the transport error's message, with counts. */
  failures: Map<string, number>
  /** Router only: samples of the decoder's instance_up gauge, ejections, and the queue. */
  d0DownSamples?: number
  samples?: number
  ejections?: number
  maxQueue?: number
}

function metricValue(text: string, re: RegExp): number {
  return [...text.matchAll(re)].reduce((a, m) => a + Number(m[1]), 0)
}

/**
 * The busy-decoder case of issue 6: 1 P + 1 D simulator, a slow decoder (40 ms per token),
 * hundreds of concurrent streamed chat requests. A direct two-leg client and the router run
 * the same load one after the other; for the router, its view of the decoder is sampled
 * throughout. Overload must show as latency and 429s, never as a decoder marked down.
 */
export async function runOverload(o: OverloadOptions): Promise<string> {
  const agent = new Agent({ connections: o.concurrency * 2, keepAliveTimeout: 4000 })
  const cluster = await startBenchCluster({ decodeDelayMs: o.decodeDelayMs })
  try {
    const { p, d } = cluster
    const body = { model: 'handoff/sim-1', messages: [{ role: 'user', content: 'tell me a long story' }], max_tokens: o.maxTokens, stream: true }
    const run = async (path: Row['path'], send: (statuses: Map<number, number>) => Promise<void>): Promise<Row> => {
      const statuses = new Map<number, number>()
      const failures = new Map<string, number>()
      const load = await closedLoop({
        concurrency: o.concurrency,
        maxRequests: Number.MAX_SAFE_INTEGER,
        maxSeconds: o.seconds,
        rampSeconds: rampSeconds(o),
        send: () =>
          send(statuses).catch((err: unknown) => {
            const what = (err as Error).message
            failures.set(what, (failures.get(what) ?? 0) + 1)
            throw err
          }),
      })
      return { path, load, statuses, failures }
    }
    const count = (statuses: Map<number, number>, status: number): void => {
      statuses.set(status, (statuses.get(status) ?? 0) + 1)
    }
    const postJson = async (url: string, b: unknown): Promise<{ status: number; json: Record<string, unknown> | undefined; text: string }> => {
      const res = await request(url, { method: 'POST', dispatcher: agent, body: JSON.stringify(b), headers: { 'content-type': 'application/json' }, headersTimeout: 120_000, bodyTimeout: 120_000 })
      const text = await res.body.text()
      return { status: res.statusCode, json: res.headers['content-type']?.toString().startsWith('application/json') ? (JSON.parse(text) as Record<string, unknown>) : undefined, text }
    }
    const fail = (status: number): never => {
      throw new Error(`HTTP ${status}`)
    }
    /** One router under the load, with its view of the decoder sampled every 500 ms. */
    const routerRow = async (path: Row['path'], url: string): Promise<Row> => {
      let samples = 0
      let down = 0
      let maxQueue = 0
      const sampler = setInterval(() => {
        void request(`${url}/metrics`, { dispatcher: agent })
          .then((r) => r.body.text())
          .then((text) => {
            samples++
            if (/^handoff_router_instance_up\{[^}]*instance="d0"[^}]*\} 0/m.test(text)) down++
            maxQueue = Math.max(maxQueue, metricValue(text, /^handoff_router_admission_queue_depth (\d+)/gm))
          })
          .catch(() => undefined)
      }, 500)
      const row = await run(path, async (statuses) => {
        const r = await postJson(`${url}/v1/chat/completions`, body)
        count(statuses, r.status)
        if (r.status !== 200) fail(r.status)
      })
      clearInterval(sampler)
      const metrics = await (await request(`${url}/metrics`, { dispatcher: agent })).body.text()
      // An older build counts ejections nowhere; its instance_up samples still tell.
      return { ...row, samples, d0DownSamples: down, maxQueue, ejections: metricValue(metrics, /^handoff_router_topology_changes_total\{type="ejected"\} (\d+)/gm) }
    }
    const direct = await run('direct', async (statuses) => {
      const pr = await postJson(`${p.url}/v1/chat/completions`, prefillBody(body))
      if (pr.status !== 200) {
        count(statuses, pr.status)
        fail(pr.status)
      }
      const dr = await postJson(`${d.url}/v1/chat/completions`, decodeBody(body, pr.json?.kv_transfer_params as Record<string, unknown>))
      count(statuses, dr.status)
      if (dr.status !== 200) fail(dr.status)
    })
    const rows: Row[] = [direct]
    for (const [path, entry] of [['router', undefined], ...(o.baseline ? [['baseline router', o.baseline] as const] : [])] as const) {
      const router = await cluster.router(entry)
      rows.push(await routerRow(path, router.url))
    }
    if (o.vllmRouter) {
      const anchor = await startVllmRouter(o.vllmRouter, p.url, d.url)
      try {
        rows.push(
          await run('vLLM Router', async (statuses) => {
            const r = await postJson(`${anchor.url}/v1/chat/completions`, body)
            count(statuses, r.status)
            if (r.status !== 200) fail(r.status)
          }),
        )
      } finally {
        await anchor.stop()
      }
    }
    return table(o, rows)
  } finally {
    await cluster.stop()
    await agent.close()
  }
}

/**
 * Clients start over one request's decode time, so streams do not run in lockstep waves; the
 * steady window, where goodput is counted, starts once all of them are running.
 */
function rampSeconds(o: OverloadOptions): number {
  return Math.min(o.seconds / 2, o.rampSeconds ?? (o.maxTokens * o.decodeDelayMs) / 1000)
}

/** 200s per second that finished in the steady window (rampSeconds to the deadline). */
function goodput(o: OverloadOptions, load: LoadResult): number {
  const from = rampSeconds(o) * 1000
  const to = o.seconds * 1000
  return load.doneAtMs.filter((t) => t >= from && t < to).length / ((to - from) / 1000)
}

function table(o: OverloadOptions, rows: Row[]): string {
  const f = (n: number, d = 0): string => (Number.isFinite(n) ? n.toFixed(d) : 'n/a')
  const lines = rows.map((r) => {
    const sorted = [...r.load.latenciesMs].sort((a, b) => a - b)
    const non200 = [...r.statuses].filter(([s]) => s !== 200).reduce((a, [, n]) => a + n, 0)
    const tooMany = r.statuses.get(429) ?? 0
    // Failed requests that got no status at all (transport errors) count as "other" too.
    const other = non200 - tooMany + (r.load.errors - non200)
    const state = r.samples === undefined ? '—' : `down in ${r.d0DownSamples}/${r.samples} samples, ${r.ejections} ejections, queue ≤ ${r.maxQueue}`
    return `| ${r.path} | ${sorted.length} | ${f(goodput(o, r.load), 1)} | ${f(percentile(sorted, 50))} / ${f(percentile(sorted, 99))} / ${f(percentile(sorted, 99.9))} / ${f(mean(sorted))} | ${tooMany} | ${other} | ${state} |`
  })
  const ratio = (rows[1]?.load.latenciesMs.length ?? 0) / Math.max(1, rows[0]?.load.latenciesMs.length ?? 0)
  const router = rows.find((r) => r.path === 'router')
  const anchor = rows.find((r) => r.path === 'vLLM Router')
  const p99 = (r: Row): number => percentile([...r.load.latenciesMs].sort((a, b) => a - b), 99)
  const vsAnchor =
    router && anchor
      ? [
          '',
          `Against vLLM Router in the same run: goodput (200s per second in the steady window) ${f(goodput(o, router.load) / goodput(o, anchor.load), 2)}x, p99 ${f(p99(router) / p99(anchor), 2)}x (issue 23: goodput ≥ 1.0x, p99 ≤ 1.1x).`,
        ]
      : []
  const why = rows
    .filter((r) => r.failures.size > 0)
    .map((r) => `- ${r.path} failures: ${[...r.failures].map(([m, n]) => `${n} × ${m}`).join('; ')}`)
  return [
    `Machine: ${cpus().length} × ${cpus()[0]?.model ?? 'cpu'}, ${(totalmem() / 2 ** 30).toFixed(0)} GiB, Node ${process.version}. 1 P + 1 D simulator (--kv none), decode ${o.decodeDelayMs} ms/token; ${o.concurrency} concurrent streamed chat requests of ${o.maxTokens} tokens for ${o.seconds} s per path (clients starting over the first ${f(rampSeconds(o), 1)} s; goodput counts the 200s finished after it), one path after the other; router with default limits (starting at 256 per instance and following the engine, queue 1024).`,
    '',
    '| path | 200s | goodput req/s | latency p50 / p99 / p99.9 / mean ms | 429s | other non-2xx or errors | decoder as the router saw it |',
    '| --- | ---: | ---: | ---: | ---: | ---: | --- |',
    ...lines,
    '',
    `Router completed ${f(ratio * 100)}% of the direct client's requests in the same time.`,
    ...vsAnchor,
    ...(why.length ? ['', ...why] : []),
    '',
  ].join('\n')
}
