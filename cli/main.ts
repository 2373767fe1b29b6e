/**
 * `handoff <command>`: one binary, one subcommand per process kind. Each command module
 * exports `main(argv)`; they are imported lazily so `handoff sim` never loads the router.
 */
import { followParent } from '../common/ready.js'
import { handoffVersion } from '../common/versions.js'

type Command = (argv: string[]) => Promise<void>

const commands: Record<string, { summary: string; load: () => Promise<Command> }> = {
  router: { summary: 'run the router (front door, topology, events)', load: async () => (await import('../router/src/main.js')).main },
  agent: { summary: 'run a transfer agent beside an engine (KV reads over NIXL, leases)', load: async () => (await import('../transfer-agent/src/main.js')).main },
  sim: { summary: 'run a vLLM-compatible engine simulator; `sim oracle` prints expected text', load: async () => (await import('../sim/src/main.js')).main },
  up: { summary: 'start a local cluster: router + simulators', load: async () => (await import('./up.js')).main },
  bench: { summary: 'run a benchmark (overhead, nixl, agent, events, routers)', load: async () => (await import('../bench/main.js')).main },
}

function usage(): string {
  const lines = Object.entries(commands).map(([name, c]) => `  ${name.padEnd(8)} ${c.summary}`)
  return `usage: handoff <command> [options]\n\ncommands:\n${lines.join('\n')}\n\nRun \`handoff <command> --help\` for a command's options, \`handoff --version\` for the version.\n`
}

const VERSION_FLAGS = new Set(['--version', '-V'])

export async function run(argv: string[]): Promise<void> {
  const [name, ...rest] = argv
  if (!name || name === '--help' || name === '-h' || name === 'help') {
    process.stdout.write(usage())
    return
  }
  // `handoff --version`, and `--version` on any command (every command is this one build).
  if (VERSION_FLAGS.has(name) || (Object.hasOwn(commands, name) && rest.some((a) => VERSION_FLAGS.has(a)))) {
    process.stdout.write(`handoff ${handoffVersion()} (node ${process.version})\n`)
    return
  }
  const command = Object.hasOwn(commands, name) ? commands[name] : undefined
  if (!command) {
    process.stderr.write(`handoff: unknown command '${name}'\n\n${usage()}`)
    process.exitCode = 2
    return
  }
  await (await command.load())(rest)
}

followParent()
run(process.argv.slice(2)).then(
  () => {
    // A command that refused to start set an exit code and returned; an IPC channel from a
    // parent (tests, `handoff up`) would keep the process alive, so leave now.
    if (typeof process.exitCode === 'number' && process.exitCode !== 0) process.exit()
  },
  (err: unknown) => {
    const e = err as { code?: string; message?: string }
    process.stderr.write(`handoff: ${e.code ? `${e.code}: ` : ''}${e.message ?? String(err)}\n`)
    process.exit(1)
  },
)
