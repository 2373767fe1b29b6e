import { parseArgs } from 'node:util'
import { freePort } from '../common/ports.js'
import { spawnService, type SpawnedService } from '../common/spawn.js'

const HELP = `usage: handoff up [--prefill N] [--decode M] [--both K] [--port P] [--host H]
                  [--kv auto|agent|none] [--lease-seconds S] [--kv-load-failure-policy fail|recompute]
                  [--model NAME] [--admin-token T] [--verbose]

Starts a local P/D cluster: N prefill and M decode simulators and a router in front of them,
each a child process on a free port. Prints "handoff ready <url>" once the router serves, and
stops every child on SIGINT/SIGTERM.

--kv agent   every simulator gets a transfer agent beside it (handoff agent), and KV moves
             between them with NIXL READs under leases of --lease-seconds (default 30).
--kv none    decoders compute the prompt's KV themselves (no NIXL needed).
--kv auto    (default) agent when NIXL loads, otherwise none, saying why on stderr.
--admin-token T   the router's admin token (POST /fault_tolerance/event and other control
             endpoints; passed in the environment, not on a command line).

With agents, the router's port is chosen first (a free one for --port 0) and every agent
follows the router's event log at it (--router-url): agents start before the router and
their link retries until it serves.
`

function count(value: string | undefined, name: string, fallback: number): number {
  if (value === undefined) return fallback
  const n = Number(value)
  if (!Number.isInteger(n) || n < 0 || n > 64) throw new Error(`--${name} must be an integer from 0 to 64, got '${value}'`)
  return n
}

/** A host to dial for a listen host: a wildcard is reached on loopback. */
function dialable(host: string): string {
  if (host === '0.0.0.0' || host === '') return '127.0.0.1'
  if (host === '::') return '[::1]'
  return host.includes(':') ? `[${host}]` : host
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
      model: { type: 'string' },
      'admin-token': { type: 'string' },
      verbose: { type: 'boolean' },
      help: { type: 'boolean', short: 'h' },
    },
  })
  if (values.help) {
    process.stdout.write(HELP)
    return
  }
  const prefill = count(values.prefill, 'prefill', 1)
  const decode = count(values.decode, 'decode', 1)
  const both = count(values.both, 'both', 0)
  if (decode + both === 0) throw new Error('a cluster needs at least one --decode or --both instance')
  const { kv, note } = await resolveKv(values.kv ?? 'auto')
  if (note) process.stderr.write(`handoff up: ${note}\n`)
  const host = values.host ?? '127.0.0.1'
  // Agents need the router's URL before it exists: fix its port now.
  const port = kv === 'agent' && (values.port ?? '8000') === '0' ? String(await freePort(host)) : (values.port ?? '8000')
  const routerUrl = `http://${dialable(host)}:${port}`
  const verbose = values.verbose === true

  const children: SpawnedService[] = []
  let stopping = false
  const stopAll = async (code: number): Promise<void> => {
    if (stopping) return
    stopping = true
    // Router first, so no request lands on a simulator that is already gone; each agent
    // after its simulator, so no engine is left without its agent.
    for (const c of [...children].reverse()) await c.stop()
    process.exit(code)
  }
  process.once('SIGINT', () => void stopAll(0))
  process.once('SIGTERM', () => void stopAll(0))

  const lease = values['lease-seconds'] ? ['--lease-seconds', values['lease-seconds']] : []
  const simArgs = [
    '--kv',
    kv,
    ...(values.model ? ['--model', values.model] : []),
    ...lease,
    ...(values['kv-load-failure-policy'] ? ['--kv-load-failure-policy', values['kv-load-failure-policy']] : []),
  ]
  const plan = [
    ...Array.from({ length: prefill }, (_, i) => ({ id: `prefill-${i}`, role: 'prefill' })),
    ...Array.from({ length: decode }, (_, i) => ({ id: `decode-${i}`, role: 'decode' })),
    ...Array.from({ length: both }, (_, i) => ({ id: `both-${i}`, role: 'both' })),
  ]
  const watch = (c: SpawnedService): void => {
    c.child.once('exit', (code, signal) => {
      if (stopping) return
      process.stderr.write(`handoff up: a child exited (${code ?? signal}); stopping the cluster\n${c.output().slice(-2000)}\n`)
      void stopAll(1)
    })
  }
  try {
    const sims = await Promise.all(
      plan.map(async (p) => {
        let agentArgs: string[] = []
        if (kv === 'agent') {
          const agent = await spawnService({ args: ['agent', '--port', '0', '--router-url', routerUrl, ...lease], inheritOutput: verbose })
          children.push(agent)
          watch(agent)
          agentArgs = ['--agent-url', agent.url]
        }
        const sim = await spawnService({ args: ['sim', '--role', p.role, '--port', '0', ...simArgs, ...agentArgs], inheritOutput: verbose })
        children.push(sim)
        watch(sim)
        return sim
      }),
    )
    const instances = plan.map((p, i) => ({ id: p.id, role: p.role, url: (sims[i] as SpawnedService).url }))
    const router = await spawnService({
      args: ['router', '--host', host, '--port', port],
      env: { ...process.env, HANDOFF_INSTANCES: JSON.stringify(instances), ...(values['admin-token'] ? { HANDOFF_ADMIN_TOKEN: values['admin-token'] } : {}) },
      inheritOutput: verbose,
    })
    children.push(router)
    watch(router)
    // stdout carries exactly one line, for scripts; the instance list goes to stderr.
    for (const inst of instances) process.stderr.write(`  ${inst.role.padEnd(7)} ${inst.id.padEnd(10)} ${inst.url}\n`)
    process.stdout.write(`handoff ready ${router.url}\n`)
  } catch (err) {
    await stopAll(1).catch(() => {})
    throw err
  }
}
