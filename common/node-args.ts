/**
 * Flags for node itself (before the script) that a handoff service runs with, wherever it is
 * started: spawnService (`handoff up`, the benches, the tests) and the Helm chart's router
 * container (deploy/helm/handoff/templates/deployment.yaml, held to this list by
 * test/deploy/helm-chart.test.ts). V8 reads them when it creates the heap, so they cannot be
 * set from inside the process.
 */

/**
 * The router: 32 MiB semi-spaces for the young generation (V8's default is 16 MiB). A request
 * lives 30-60 ms under load, and at 2,000 requests a second a 16 MiB semi-space fills every
 * 50-70 ms, so much of every request outlived two scavenges and was copied into the old
 * generation, which then needed a mark-compact every 1.3 s. Measured at concurrency 64
 * (docs/benchmarks.md): 5-13 % less CPU per request in six of six alternating pairs.
 */
export const ROUTER_NODE_ARGS: readonly string[] = ['--max-semi-space-size=32']

/** The node flags for `handoff <command>`. */
export function nodeArgsFor(command: string | undefined): readonly string[] {
  return command === 'router' ? ROUTER_NODE_ARGS : []
}
