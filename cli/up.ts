import { parseArgs } from 'node:util'
import { spawnService, type SpawnedService } from '../common/spawn.js'

const HELP = `usage: handoff up [--prefill N] [--decode M] [--both K] [--port P] [--host H]
                  [--kv none] [--lease-seconds S] [--model NAME] [--verbose]

Starts a local P/D cluster: N prefill and M decode simulators and a router in front of them,
each a child process on a free port. Prints "handoff ready <url>" once the router serves, and
stops every child on SIGINT/SIGTERM.
`

function count(value: string | undefined, name: string, fallback: number): number {
  if (value === undefined) return fallback
  const n = Number(value)
  if (!Number.isInteger(n) || n < 0 || n > 64) throw new Error(`--${name} must be an integer from 0 to 64, got '${value}'`)
  return n
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
      model: { type: 'string' },
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
  const kv = values.kv ?? 'none'
  if (kv !== 'none') throw new Error(`--kv ${kv} is not available yet; use --kv none`)
  const port = values.port ?? '8000'
  const host = values.host ?? '127.0.0.1'

  const children: SpawnedService[] = []
  let stopping = false
  const stopAll = async (code: number): Promise<void> => {
    if (stopping) return
    stopping = true
    // Router first, so no request lands on a simulator that is already gone.
    for (const c of [...children].reverse()) await c.stop()
    process.exit(code)
  }
  process.once('SIGINT', () => void stopAll(0))
  process.once('SIGTERM', () => void stopAll(0))

  const common = ['--kv', kv, ...(values.model ? ['--model', values.model] : []), ...(values['lease-seconds'] ? ['--lease-seconds', values['lease-seconds']] : [])]
  const plan = [
    ...Array.from({ length: prefill }, (_, i) => ({ id: `prefill-${i}`, role: 'prefill' })),
    ...Array.from({ length: decode }, (_, i) => ({ id: `decode-${i}`, role: 'decode' })),
    ...Array.from({ length: both }, (_, i) => ({ id: `both-${i}`, role: 'both' })),
  ]
  try {
    const sims = await Promise.all(
      plan.map((p) =>
        spawnService({ args: ['sim', '--role', p.role, '--port', '0', ...common], inheritOutput: values.verbose === true }),
      ),
    )
    children.push(...sims)
    const instances = plan.map((p, i) => ({ id: p.id, role: p.role, url: (sims[i] as SpawnedService).url }))
    const router = await spawnService({
      args: ['router', '--host', host, '--port', port],
      env: { ...process.env, HANDOFF_INSTANCES: JSON.stringify(instances) },
      inheritOutput: values.verbose === true,
    })
    children.push(router)
    for (const c of children) {
      c.child.once('exit', (code, signal) => {
        if (stopping) return
        process.stderr.write(`handoff up: a child exited (${code ?? signal}); stopping the cluster\n${c.output().slice(-2000)}\n`)
        void stopAll(1)
      })
    }
    // stdout carries exactly one line, for scripts; the instance list goes to stderr.
    for (const inst of instances) process.stderr.write(`  ${inst.role.padEnd(7)} ${inst.id.padEnd(10)} ${inst.url}\n`)
    process.stdout.write(`handoff ready ${router.url}\n`)
  } catch (err) {
    await stopAll(1).catch(() => {})
    throw err
  }
}
