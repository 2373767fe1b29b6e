import { request } from 'undici'

/*
 * An engine's vLLM metrics, scraped from its /metrics: a real vLLM (bench/vllm-engine.ts) or
 * the simulator, which exports the same names (test/helpers/sim-engine.ts).
 */

async function metricsText(url: string): Promise<string> {
  const res = await request(`${url}/metrics`)
  return res.body.text()
}

/** Every series of metric `name`: its label text ('' without labels) and value. */
async function series(url: string, name: string): Promise<[string, number][]> {
  const escaped = name.replace(/[.*+?^${}()|[\]\\]/g, '\\$&')
  const re = new RegExp(`^${escaped}(?:\\{([^}]*)\\})? ([0-9.e+-]+)$`, 'gm')
  return [...(await metricsText(url)).matchAll(re)].map((m) => [m[1] ?? '', Number(m[2])])
}

/** A gauge or counter summed over its label sets (e.g. vllm:kv_cache_usage_perc). */
async function metric(url: string, name: string): Promise<number> {
  return (await series(url, name)).reduce((sum, [, v]) => sum + v, 0)
}

/** vllm:prompt_tokens_by_source_total by source: where the engine got each prompt token. */
async function promptTokens(url: string): Promise<Record<string, number>> {
  const out: Record<string, number> = {}
  for (const [labels, v] of await series(url, 'vllm:prompt_tokens_by_source_total')) {
    const source = /source="([a-z_]+)"/.exec(labels)?.[1]
    if (source) out[source] = (out[source] ?? 0) + v
  }
  return out
}

/** An engine that serves vLLM's metrics at `url`/metrics: the scrapes above as methods. */
export abstract class ScrapedEngine {
  abstract get url(): string

  metrics(): Promise<string> {
    return metricsText(this.url)
  }

  promptTokens(): Promise<Record<string, number>> {
    return promptTokens(this.url)
  }

  series(name: string): Promise<[string, number][]> {
    return series(this.url, name)
  }

  metric(name: string): Promise<number> {
    return metric(this.url, name)
  }

  /** ms until the engine holds no KV block (vllm:kv_cache_usage_perc 0), polled; NaN if not within limitMs. */
  async msUntilNoKv(limitMs: number, stepMs = 10): Promise<number> {
    const from = performance.now()
    while (performance.now() - from < limitMs && (await this.metric('vllm:kv_cache_usage_perc')) > 0) await new Promise((r) => setTimeout(r, stepMs))
    return (await this.metric('vllm:kv_cache_usage_perc')) === 0 ? performance.now() - from : Number.NaN
  }
}
