import { Counter, Gauge, Histogram, Registry } from 'prom-client'

/**
 * vLLM's metric names (protocol reference §6), labelled model_name and engine like vLLM's
 * own, so the router's scraper and dashboards work unchanged against the simulator. Counters
 * that vLLM exposes with a `_total` suffix are declared with it (prom-client adds none).
 */
export interface SimMetrics {
  readonly registry: Registry
  running: Gauge<'model_name' | 'engine'>
  waiting: Gauge<'model_name' | 'engine'>
  kvUsage: Gauge<'model_name' | 'engine'>
  success: Counter<'model_name' | 'engine' | 'finished_reason'>
  promptTokens: Counter<'model_name' | 'engine'>
  promptTokensBySource: Counter<'model_name' | 'engine' | 'source'>
  prefixCacheQueries: Counter<'model_name' | 'engine'>
  prefixCacheHits: Counter<'model_name' | 'engine'>
  generationTokens: Counter<'model_name' | 'engine'>
  ttft: Histogram<'model_name' | 'engine'>
  kvExpired: Counter<'model_name' | 'engine'>
  failedTransfers: Counter<'model_name' | 'engine'>
  kvRecomputed: Counter<'model_name' | 'engine'>
  readonly labels: { model_name: string; engine: string }
}

export interface SimMetricsOptions {
  registry: Registry
  model: string
  /** Read when /metrics is scraped: fraction of KV blocks in use (0–1). */
  kvUsage: () => number
}

export function createSimMetrics(opts: SimMetricsOptions): SimMetrics {
  const registers = [opts.registry]
  // vLLM labels `engine` with the engine core index; one engine per simulator process.
  const labels = { model_name: opts.model, engine: '0' }
  const labelNames = ['model_name', 'engine'] as const
  const kvUsage = new Gauge({
    name: 'vllm:kv_cache_usage_perc',
    help: 'KV-cache usage. 1 means 100 percent usage.',
    labelNames,
    registers,
    collect() {
      this.set(labels, opts.kvUsage())
    },
  })
  const m: SimMetrics = {
    registry: opts.registry,
    labels,
    running: new Gauge({ name: 'vllm:num_requests_running', help: 'Number of requests in model execution batches.', labelNames, registers }),
    waiting: new Gauge({ name: 'vllm:num_requests_waiting', help: 'Number of requests waiting to be processed.', labelNames, registers }),
    kvUsage,
    success: new Counter({
      name: 'vllm:request_success_total',
      help: 'Count of successfully processed requests.',
      labelNames: ['model_name', 'engine', 'finished_reason'],
      registers,
    }),
    promptTokens: new Counter({ name: 'vllm:prompt_tokens_total', help: 'Number of prefill tokens processed.', labelNames, registers }),
    // Where each prompt token came from, as vLLM 0.32 counts it: a decode leg that read the
    // prompt's KV from P counts it external_kv_transfer, one that computed it local_compute.
    promptTokensBySource: new Counter({
      name: 'vllm:prompt_tokens_by_source_total',
      help: 'Number of prompt tokens by source.',
      labelNames: ['model_name', 'engine', 'source'],
      registers,
    }),
    // Tokens looked up in the prefix cache and tokens found, per request scheduled (vLLM's
    // PrefixCacheStats): hits over queries is the engine's own hit rate.
    prefixCacheQueries: new Counter({ name: 'vllm:prefix_cache_queries_total', help: 'Prefix cache queries, in terms of number of queried tokens.', labelNames, registers }),
    prefixCacheHits: new Counter({ name: 'vllm:prefix_cache_hits_total', help: 'Prefix cache hits, in terms of number of cached tokens.', labelNames, registers }),
    generationTokens: new Counter({ name: 'vllm:generation_tokens_total', help: 'Number of generation tokens processed.', labelNames, registers }),
    ttft: new Histogram({
      name: 'vllm:time_to_first_token_seconds',
      help: 'Histogram of time to first token in seconds.',
      labelNames,
      registers,
      buckets: [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10],
    }),
    kvExpired: new Counter({
      name: 'vllm:nixl_num_kv_expired_reqs_total',
      help: 'Number of requests whose KV blocks expired before every consumer read them.',
      labelNames,
      registers,
    }),
    failedTransfers: new Counter({ name: 'vllm:nixl_num_failed_transfers_total', help: 'Number of failed NIXL KV transfers.', labelNames, registers }),
    // Not a vLLM metric: vLLM logs its recomputes; scenario tests count them here.
    kvRecomputed: new Counter({
      name: 'handoff_sim_kv_recomputed_requests_total',
      help: 'Decode requests whose KV pull failed and that prefilled locally (kv_load_failure_policy=recompute).',
      labelNames,
      registers,
    }),
  }
  // Zero-valued series exist from the start, so a scrape before traffic shows every name.
  m.running.set(labels, 0)
  m.waiting.set(labels, 0)
  m.promptTokens.inc(labels, 0)
  m.generationTokens.inc(labels, 0)
  m.prefixCacheQueries.inc(labels, 0)
  m.prefixCacheHits.inc(labels, 0)
  for (const source of ['local_compute', 'local_cache_hit', 'external_kv_transfer']) m.promptTokensBySource.inc({ ...labels, source }, 0)
  m.kvExpired.inc(labels, 0)
  m.failedTransfers.inc(labels, 0)
  m.kvRecomputed.inc(labels, 0)
  m.success.inc({ ...labels, finished_reason: 'length' }, 0)
  return m
}
