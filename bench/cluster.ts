import { spawnService, type SpawnedService } from '../common/spawn.js'

/** A 1 P + 1 D simulator pair (`--kv none`: the router is measured, not KV bytes) and routers in front. */
export interface BenchCluster {
  p: SpawnedService
  d: SpawnedService
  /**
   * Starts a router process over the pair; `entry` runs another build's CLI and `node` another
   * Node binary (a baseline).
   */
  router(entry?: string, node?: string): Promise<SpawnedService>
  /** Keeps `s` to be stopped with the cluster. */
  own(s: SpawnedService): SpawnedService
  stop(): Promise<void>
}

/** `decodeArgs`: more flags for the decoder; `routerEnv`: more environment for its routers. */
export async function startBenchCluster(opts: { decodeDelayMs?: number; decodeArgs?: string[]; routerEnv?: NodeJS.ProcessEnv } = {}): Promise<BenchCluster> {
  const services: SpawnedService[] = []
  const own = (s: SpawnedService): SpawnedService => {
    services.push(s)
    return s
  }
  const sim = (role: string, extra: string[] = []) => spawnService({ args: ['sim', '--role', role, '--kv', 'none', '--log-level', 'warn', ...extra] }).then(own)
  const [p, d] = await Promise.all([sim('prefill'), sim('decode', [...(opts.decodeDelayMs ? ['--decode-delay-ms', String(opts.decodeDelayMs)] : []), ...(opts.decodeArgs ?? [])])])
  const instances = JSON.stringify([
    { id: 'p0', role: 'prefill', url: p.url },
    { id: 'd0', role: 'decode', url: d.url },
  ])
  return {
    p,
    d,
    own,
    router: (entry, node) =>
      spawnService({ ...(entry ? { entry } : {}), ...(node ? { node } : {}), args: ['router', '--port', '0', '--log-level', 'warn'], env: { ...process.env, ...opts.routerEnv, HANDOFF_INSTANCES: instances } }).then(own),
    stop: async () => {
      await Promise.all(services.map((s) => s.stop()))
    },
  }
}
