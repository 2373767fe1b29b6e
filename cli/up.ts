import { spawn, spawnSync } from 'node:child_process'
import { mkdtempSync, rmSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { randomBytes } from 'node:crypto'
import { once } from 'node:events'
import { parseArgs } from 'node:util'
import { freePort } from '../common/ports.js'
import { spawnService, type SpawnedService, type SpawnOptions } from '../common/spawn.js'
import { urlHost } from '../common/host-port.js'

const HELP = () => `usage: handoff up [--prefill N] [--decode M] [--both K] [--port P] [--host H]
                  [--kv auto|agent|none] [--lease-seconds S] [--kv-load-failure-policy fail|recompute]
                  [--block-size B] [--num-gpu-blocks-override N] [--kv-events on|off]
                  [--routers R] [--store memory|redis|redis://HOST:PORT]
                  [--model NAME] [--admin-token T] [--verbose]

Starts a local P/D cluster: N prefill and M decode simulators and a router in front of them,
each a child process on a free port. Prints "handoff ready <url>" once the router serves, and
stops every child on SIGINT/SIGTERM.

--kv agent   every simulator gets a transfer agent beside it (handoff agent), and KV moves
             between them with NIXL READs under leases of --lease-seconds (default 30).
--kv none    decoders compute the prompt's KV themselves (no NIXL needed).
--kv auto    (default) agent when NIXL loads, otherwise none, saying why on stderr.
--block-size B, --num-gpu-blocks-override N
             every simulator's KV blocks (tokens each, default 16) and pool size (blocks,
             default 16384), vLLM's flags; each keeps a prefix cache over its pool.
--kv-events on|off
             on (default): every simulator publishes its KV cache events as vLLM does
             (--kv-events-config, a ZMQ PUB and a replay socket on free loopback ports) and
             the routers follow them into their prefix index (docs/routing.md).
--admin-token T   the router's admin token (POST /fault_tolerance/event and other control
             endpoints; passed in the environment, not on a command line).
--routers R  R router replicas (default 1, at most 16) over the same simulators, sharing one
             store (docs/several-routers.md). The first listens on --port, the others on free
             ports; "handoff ready" names the first, stderr the others. R > 1 needs --store redis
             or a redis:// URL.
--store S    the routers' store: memory (default; one router alone), a redis:// URL used as
             given, or redis: a local redis-server child on a free loopback port, with an
             append-only file in a temporary folder (so a restart of it keeps the log, as a
             production Redis would), stopped and removed with the cluster (needs
             redis-server installed). Routers get it in the environment (HANDOFF_STORE), not on
             a command line.

A router or the local redis-server that exits is started again at its port, up to
${MAX_RESTARTS} times each, saying which one and why on stderr; the rest of the cluster keeps
serving meanwhile. Any other child that exits stops the cluster, naming it.

With agents, every router's port is chosen first (a free one for --port 0) and every agent
follows the routers' event log (--router-url, every router's URL, the first router first,
the next one when one cannot be reached): agents start before the routers and their link
retries until one serves.
`
/** vLLM's --kv-events-config for every simulator: wildcards are bound, to free ports on its host. */
const KV_EVENTS = JSON.stringify({ enable_kv_cache_events: true, publisher: 'zmq', endpoint: 'tcp://*:0', replay_endpoint: 'tcp://*:0' })

/** Where a simulator publishes its KV events, as its /sim/info names the bound endpoints. */
async function publishedKvEvents(simUrl: string): Promise<{ endpoint: string; replayEndpoint?: string } | undefined> {
  const res = await fetch(`${simUrl}/sim/info`)
  if (!res.ok) throw new Error(`${simUrl}/sim/info answered ${res.status}`)
  const info = (await res.json()) as { kvEvents?: { endpoint: string; replayEndpoint: string | null } | null }
  if (!info.kvEvents) return undefined
  return { endpoint: info.kvEvents.endpoint, ...(info.kvEvents.replayEndpoint ? { replayEndpoint: info.kvEvents.replayEndpoint } : {}) }
}

const MAX_ROUTERS = 16
/** Restarts of one router or the local Redis before `handoff up` gives up and stops the cluster. */
const MAX_RESTARTS = 5

function count(value: string | undefined, name: string, fallback: number): number {
  if (value === undefined) return fallback
  const n = Number(value)
  if (!Number.isInteger(n) || n < 0 || n > 64) throw new Error(`--${name} must be an integer from 0 to 64, got '${value}'`)
  return n
}

function routerCount(value: string | undefined): number {
  if (value === undefined) return 1
  const n = Number(value)
  if (!Number.isInteger(n) || n < 1 || n > MAX_ROUTERS) throw new Error(`--routers must be an integer from 1 to ${MAX_ROUTERS}, got '${value}'`)
  return n
}

/** `--store`: memory, a redis:// URL as given, or `redis` (a local redis-server this command runs). */
type StoreChoice = { kind: 'memory' } | { kind: 'url'; url: string } | { kind: 'local' }

function storeOption(value: string | undefined, routers: number): StoreChoice | undefined {
  let store: StoreChoice | undefined
  if (value === undefined) store = undefined
  else if (value === 'memory') store = { kind: 'memory' }
  else if (value === 'redis') store = { kind: 'local' }
  else if (/^rediss?(\+sentinel)?:\/\/\S+$/.test(value)) store = { kind: 'url', url: value }
  else throw new Error(`--store must be memory, redis or a redis:// URL, got '${value}'`)
  // Routers on separate memory stores would each see only their own events and leases.
  if (routers > 1 && (store === undefined || store.kind === 'memory')) {
    throw new Error(`--routers ${routers} needs a store the routers share: --store redis (a local redis-server) or --store redis://HOST:PORT`)
  }
  if (store?.kind === 'local' && spawnSync('redis-server', ['--version'], { stdio: 'ignore' }).error) {
    throw new Error('--store redis runs a local redis-server, which is not installed (Debian/Ubuntu: apt-get install redis-server); or pass --store redis://HOST:PORT')
  }
  return store
}

/*
 * redis-server has no parent-death option, so a wrapper shell stops it when its stdin (a pipe
 * from this process) closes: on a clean stop, and when `handoff up` is killed outright, as the
 * handoff children do when their IPC channel closes. SIGTERM to the wrapper stops it too. The
 * reader runs in the background, where sh gives it /dev/null unless it reads a saved copy (fd 3).
 */
const REDIS_WRAPPER = `exec 3<&0
redis-server "$@" & r=$!
(read _ <&3; kill $r) 2>/dev/null & w=$!
trap 'kill $r 2>/dev/null' TERM INT HUP
s=1
while kill -0 $r 2>/dev/null; do wait $r; s=$?; done
kill $w 2>/dev/null
exit $s`

/**
 * A local redis-server on loopback at `port` (a free one when 0), its append-only file in
 * `dir` (appendfsync everysec, no RDB snapshots); resolves once it accepts connections.
 */
async function startLocalRedis(verbose: boolean, dir: string, port = 0): Promise<SpawnedService> {
  port ||= await freePort('127.0.0.1')
  const args = ['--port', String(port), '--bind', '127.0.0.1', '--save', '', '--appendonly', 'yes', '--appendfsync', 'everysec', '--dir', dir]
  const child = spawn('sh', ['-c', REDIS_WRAPPER, 'redis-server', ...args], { stdio: ['pipe', 'pipe', 'pipe'] })
  let buffer = ''
  let announced: () => void = () => {}
  const listening = new Promise<true>((resolve) => (announced = () => resolve(true)))
  const collect = (chunk: Buffer): void => {
    if (verbose) process.stderr.write(chunk)
    buffer = (buffer + chunk.toString('utf8')).slice(-65536)
    // Redis 2.x to 7.x all log this once the listening socket is open.
    if (/ready to accept connections/i.test(buffer)) announced()
  }
  child.stdout.on('data', collect)
  child.stderr.on('data', collect)
  const exited = once(child, 'exit') as Promise<[number | null, NodeJS.Signals | null]>
  const service: SpawnedService = {
    url: `redis://127.0.0.1:${port}`,
    child,
    output: () => buffer,
    async stop(graceMs = 5000) {
      if (child.exitCode !== null || child.signalCode !== null) return child.exitCode ?? child.signalCode
      child.stdin.end()
      child.kill('SIGTERM')
      const timer = setTimeout(() => child.kill('SIGKILL'), graceMs)
      const [code, signal] = await exited
      clearTimeout(timer)
      return code ?? signal
    },
  }
  let timer: NodeJS.Timeout | undefined
  const ready = await Promise.race([listening, exited.then(() => false), new Promise<false>((resolve) => (timer = setTimeout(() => resolve(false), 10000)))])
  clearTimeout(timer)
  if (!ready) {
    await service.stop()
    throw new Error(`redis-server on 127.0.0.1:${port} did not start\n${buffer}`)
  }
  return service
}

/** A host to dial for a listen host: a wildcard is reached on loopback. */
function dialable(host: string): string {
  if (host === '0.0.0.0' || host === '') return '127.0.0.1'
  if (host === '::') return '[::1]'
  return urlHost(host)
}

/** `auto` → agent when NIXL loads here; otherwise none, with the reason. */
async function resolveKv(kv: string): Promise<{ kv: 'agent' | 'none'; note?: string }> {
  if (kv === 'agent' || kv === 'none') return { kv }
  if (kv !== 'auto') throw new Error(`--kv must be auto, agent or none, got '${kv}'`)
  try {
    const { loadNixl } = await import('../native/index.js')
    const info = await loadNixl(process.env.NIXL_LIB_DIR ? { libDir: process.env.NIXL_LIB_DIR } : {})
    return { kv: 'agent', note: `KV moves through transfer agents (NIXL ${info.version ?? ''} from ${info.path})` }
  } catch (err) {
    const e = err as { code?: string; message?: string }
    return { kv: 'none', note: `NIXL is not available (${e.code ?? 'error'}: ${e.message ?? String(err)}): falling back to --kv none, decoders recompute KV` }
  }
}

/** `handoff up`: the local cluster behind `npm start`. */
export async function main(argv: string[]): Promise<void> {
  const { values } = parseArgs({
    args: argv,
    options: {
      prefill: { type: 'string' },
      decode: { type: 'string' },
      both: { type: 'string' },
      port: { type: 'string' },
      host: { type: 'string' },
      kv: { type: 'string' },
      'lease-seconds': { type: 'string' },
      'kv-load-failure-policy': { type: 'string' },
      'block-size': { type: 'string' },
      'num-gpu-blocks-override': { type: 'string' },
      'kv-events': { type: 'string' },
      model: { type: 'string' },
      'admin-token': { type: 'string' },
      routers: { type: 'string' },
      store: { type: 'string' },
      verbose: { type: 'boolean' },
      help: { type: 'boolean', short: 'h' },
    },
  })
  if (values.help) {
    process.stdout.write(HELP())
    return
  }
  const prefill = count(values.prefill, 'prefill', 1)
  const decode = count(values.decode, 'decode', 1)
  const both = count(values.both, 'both', 0)
  if (decode + both === 0) throw new Error('a cluster needs at least one --decode or --both instance')
  const routers = routerCount(values.routers)
  const store = storeOption(values.store, routers)
  const kvEvents = values['kv-events'] ?? 'on'
  if (kvEvents !== 'on' && kvEvents !== 'off') throw new Error(`--kv-events must be on or off, got '${kvEvents}'`)
  const { kv, note } = await resolveKv(values.kv ?? 'auto')
  if (note) process.stderr.write(`handoff up: ${note}\n`)
  const host = values.host ?? '127.0.0.1'
  // Agents need every router's URL before the routers exist: fix their ports now. Without
  // agents the routers after the first take port 0, so no port is raced for.
  const fixed = kv === 'agent'
  const first = values.port ?? '8000'
  const ports = [fixed && first === '0' ? String(await freePort(host)) : first]
  for (let i = 1; i < routers; i++) ports.push(fixed ? String(await freePort(host)) : '0')
  const routerUrls = ports.map((p) => `http://${dialable(host)}:${p}`).join(',')
  const verbose = values.verbose === true

  const children: SpawnedService[] = []
  /** Run once every child stopped (the local Redis's folder). */
  const cleanups: (() => void)[] = []
  // A child is listed once it is ready; until then it is only here, and stopping waits for it:
  // a child that has not announced itself does not yet stop when this process dies.
  const starting = new Set<Promise<SpawnedService>>()
  let stopping: Promise<void> | undefined
  // Routers first, so no request lands on a simulator that is already gone; each agent
  // after its simulator, so no engine is left without its agent; a local Redis last.
  const stopChildren = (): Promise<void> =>
    (stopping ??= (async () => {
      while (starting.size > 0) await Promise.allSettled([...starting])
      for (const c of [...children].reverse()) await c.stop()
      for (const clean of cleanups) clean()
    })())
  const stopAll = async (code: number): Promise<void> => {
    if (stopping) return
    await stopChildren()
    process.exit(code)
  }
  process.once('SIGINT', () => void stopAll(0))
  process.once('SIGTERM', () => void stopAll(0))

  // Routers listening beyond loopback need an agent token (they refuse to start without one):
  // one is made for this cluster unless HANDOFF_AGENT_TOKEN gives it.
  const loopback = host === 'localhost' || host === '::1' || host.startsWith('127.')
  const agentToken = process.env.HANDOFF_AGENT_TOKEN ?? (loopback ? undefined : randomBytes(16).toString('hex'))
  if (agentToken && !process.env.HANDOFF_AGENT_TOKEN) process.stderr.write('handoff up: routers listen beyond loopback: agents authenticate with a token made for this cluster\n')
  const withToken = agentToken ? { ...process.env, HANDOFF_AGENT_TOKEN: agentToken } : process.env
  // The agents' handshake credential, separate from the token whenever there is one; only
  // agents get it.
  const peerSecret = process.env.HANDOFF_PEER_SECRET ?? (agentToken ? randomBytes(16).toString('hex') : undefined)
  const agentEnv = peerSecret ? { ...withToken, HANDOFF_PEER_SECRET: peerSecret } : withToken
  const lease = values['lease-seconds'] ? ['--lease-seconds', values['lease-seconds']] : []
  const simArgs = [
    '--kv',
    kv,
    ...(values.model ? ['--model', values.model] : []),
    ...lease,
    ...(values['kv-load-failure-policy'] ? ['--kv-load-failure-policy', values['kv-load-failure-policy']] : []),
    ...(values['block-size'] ? ['--block-size', values['block-size']] : []),
    ...(values['num-gpu-blocks-override'] ? ['--num-gpu-blocks-override', values['num-gpu-blocks-override']] : []),
    ...(kvEvents === 'on' ? ['--kv-events-config', KV_EVENTS] : []),
  ]
  const plan = [
    ...Array.from({ length: prefill }, (_, i) => ({ id: `prefill-${i}`, role: 'prefill' })),
    ...Array.from({ length: decode }, (_, i) => ({ id: `decode-${i}`, role: 'decode' })),
    ...Array.from({ length: both }, (_, i) => ({ id: `both-${i}`, role: 'both' })),
  ]
  const restarts = new Map<string, number>()
  /**
   * Lists a child and follows it: when it exits, `restart` (a router, the local Redis) starts
   * it again, up to MAX_RESTARTS times; any other child, or one past its restarts, stops the
   * cluster. Either way stderr names the child and says why.
   */
  const watch = (c: SpawnedService, name: string, restart?: (at: number) => Promise<SpawnedService>, at = children.length): void => {
    // A restarted child takes its predecessor's place: the order of `children` is the order they stop in.
    children.splice(at, 0, c)
    c.child.once('exit', (code, signal) => {
      if (stopping) return
      const why = `${name} exited (${code ?? signal})`
      const n = (restarts.get(name) ?? 0) + 1
      const tail = c.output().slice(-2000)
      if (!restart || n > MAX_RESTARTS) {
        process.stderr.write(`handoff up: ${why}; stopping the cluster${restart ? ` (it was restarted ${MAX_RESTARTS} times already)` : ''}\n${tail}\n`)
        void stopAll(1)
        return
      }
      restarts.set(name, n)
      const place = children.indexOf(c)
      children.splice(place, 1)
      process.stderr.write(`handoff up: ${why}; starting it again (restart ${n} of ${MAX_RESTARTS})\n${tail}\n`)
      restart(place).then(
        (next) => process.stderr.write(`handoff up: ${name} is back at ${next.url}\n`),
        (err: unknown) => {
          if (stopping) return
          process.stderr.write(`handoff up: ${name} did not start again (${(err as Error).message}); stopping the cluster\n`)
          void stopAll(1)
        },
      )
    })
  }
  const start = async (opts: SpawnOptions, name: string, restartable = false, at?: number): Promise<SpawnedService> => {
    if (stopping) throw new Error('handoff up is stopping')
    const started = spawnService({ ...opts, inheritOutput: verbose })
    starting.add(started)
    try {
      const c = await started
      // Again at the same port, so agents and clients find it where it was.
      const again = { ...opts, args: opts.args.map((a, i) => (opts.args[i - 1] === '--port' ? new URL(c.url).port : a)) }
      watch(c, name, restartable ? (place) => start(again, name, true, place) : undefined, at)
      return c
    } finally {
      starting.delete(started)
    }
  }
  try {
    let storeUrl = store?.kind === 'url' ? store.url : store?.kind
    if (store?.kind === 'local') {
      const dir = mkdtempSync(join(tmpdir(), 'handoff-up-redis-'))
      cleanups.push(() => rmSync(dir, { recursive: true, force: true }))
      const redis = await startLocalRedis(verbose, dir)
      const port = Number(new URL(redis.url).port)
      const again = async (place: number): Promise<SpawnedService> => {
        const next = await startLocalRedis(verbose, dir, port)
        watch(next, 'the local redis-server', again, place)
        return next
      }
      watch(redis, 'the local redis-server', again)
      storeUrl = redis.url
      process.stderr.write(`handoff up: store ${redis.url} (a local redis-server, its append-only file in ${dir})\n`)
    }
    const sims = await Promise.all(
      plan.map(async (p) => {
        let agentUrl: string | undefined
        if (kv === 'agent') {
          agentUrl = (await start({ args: ['agent', '--port', '0', '--router-url', routerUrls, ...lease], env: agentEnv }, `the agent of ${p.id}`)).url
        }
        const sim = await start(
          { args: ['sim', '--role', p.role, '--port', '0', ...simArgs, ...(agentUrl ? ['--agent-url', agentUrl] : []), ...(agentUrl && agentToken ? ['--agent-token', agentToken] : [])] },
          `simulator ${p.id}`,
        )
        const events = kvEvents === 'on' ? await publishedKvEvents(sim.url) : undefined
        return { instance: { id: p.id, role: p.role, url: sim.url, ...(events ? { kvEvents: events } : {}) }, agentUrl }
      }),
    )
    const instances = sims.map((s) => s.instance)
    // Every router gets the same instances, tokens and store. The store goes in the environment
    // as the admin token does: a redis:// URL can carry a password.
    const env = {
      ...withToken,
      HANDOFF_INSTANCES: JSON.stringify(instances),
      ...(values['admin-token'] ? { HANDOFF_ADMIN_TOKEN: values['admin-token'] } : {}),
      ...(storeUrl ? { HANDOFF_STORE: storeUrl } : {}),
      // One lease length everywhere: the router's ledger judges the engines' leases.
      ...(values['lease-seconds'] ? { HANDOFF_LEASE_SECONDS: values['lease-seconds'] } : {}),
    }
    const started = await Promise.all(ports.map((p, i) => start({ args: ['router', '--host', host, '--port', p], env }, `router ${i + 1}`, true)))
    // stdout carries exactly one line, for scripts; the instance list and the other routers go to stderr.
    for (const { instance: i, agentUrl } of sims) process.stderr.write(`  ${i.role.padEnd(7)} ${i.id.padEnd(10)} ${i.url}${agentUrl ? `  agent ${agentUrl}` : ''}\n`)
    started.forEach((r, i) => {
      if (i > 0) process.stderr.write(`handoff up: router ${i + 1} at ${r.url}\n`)
    })
    process.stdout.write(`handoff ready ${(started[0] as SpawnedService).url}\n`)
  } catch (err) {
    // Stop what started, then let the CLI print why (stopAll would exit before it could).
    await stopChildren().catch(() => {})
    throw err
  }
}
