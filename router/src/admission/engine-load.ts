/** What an engine says of its own load: requests it runs, and requests its scheduler holds waiting. */
export interface EngineLoad {
  running: number
  waiting: number
}

const RUNNING = 'vllm:num_requests_running'
const WAITING = 'vllm:num_requests_waiting'

/**
 * The two gauges out of an engine's Prometheus text (vLLM's /metrics, and the simulator's),
 * summed over their label sets (a data-parallel engine reports one series per rank).
 * Undefined when either is missing: not a vLLM engine, or not one that says.
 */
export function parseEngineLoad(text: string): EngineLoad | undefined {
  let running: number | undefined
  let waiting: number | undefined
  // A scan for the two names, not a parse of the whole page: vLLM's is ~100 KB of histograms.
  for (const [name, add] of [
    [RUNNING, (v: number) => (running = (running ?? 0) + v)],
    [WAITING, (v: number) => (waiting = (waiting ?? 0) + v)],
  ] as const) {
    for (let at = text.indexOf(name); at >= 0; at = text.indexOf(name, at + name.length)) {
      if (at > 0 && text[at - 1] !== '\n') continue
      const next = text[at + name.length]
      if (next !== '{' && next !== ' ') continue
      const eol = text.indexOf('\n', at)
      const line = text.slice(at, eol < 0 ? undefined : eol)
      // `name{labels} value [timestamp]`: the value follows the labels (which may hold spaces).
      const close = line.lastIndexOf('}')
      const fields = line.slice(close >= 0 ? close + 1 : name.length).trim().split(/\s+/)
      const v = Number(fields[0])
      if (Number.isFinite(v)) add(v)
    }
  }
  return running === undefined || waiting === undefined ? undefined : { running, waiting }
}
