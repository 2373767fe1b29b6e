/** `handoff bench <name>`: benchmarks as commands; results go to docs/benchmarks.md. */
const benches: Record<string, () => Promise<(argv: string[]) => Promise<void>>> = {
  overhead: async () => (await import('./overhead.js')).runOverheadBench,
  nixl: async () => (await import('./nixl.js')).runNixlBench,
  agent: async () => (await import('./agent.js')).runAgentBench,
  events: async () => (await import('./events.js')).runEventsBench,
  // The router against a direct two-leg client on real vLLM engines (issue 19).
  real: async () => (await import('./real.js')).runRealBench,
  // handoff's vLLM connector against stock vLLM on the same real engines (issue 20).
  connector: async () => (await import('./connector.js')).runConnectorBench,
  // Several routers on one Redis against one in memory (issue 10).
  routers: async () => (await import('./routers.js')).runRoutersBench,
  // Overload must never mark a healthy decoder down: the run, repeated (issue 37 item 5).
  overload: async () => (await import('./overload-runs.js')).runOverloadRunsBench,
  // This build's router against another build's, serving at once (issue 23 item 2).
  paired: async () => (await import('./paired.js')).runPairedBench,
  // Internal: the baseline proxy that `overhead` starts as a child process.
  'bare-proxy': async () => (await import('./bare-proxy.js')).runBareProxy,
}

export async function main(argv: string[]): Promise<void> {
  const [name, ...rest] = argv
  const load = name ? benches[name] : undefined
  if (!load) {
    process.stdout.write(`usage: handoff bench <${Object.keys(benches).join('|')}> [options]\n`)
    if (name && name !== '--help' && name !== '-h') process.exitCode = 2
    return
  }
  await (await load())(rest)
}
