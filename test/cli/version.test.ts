import { spawnSync } from 'node:child_process'
import { readFileSync } from 'node:fs'
import { join } from 'node:path'
import t from 'tap'
import { cliEntry, packageRoot } from '../../common/paths.js'

/* Issue 40 item 2: `--version` on `handoff` and every command, from the real binary. */

const { version } = JSON.parse(readFileSync(join(packageRoot, 'package.json'), 'utf8')) as { version: string }
const run = (...args: string[]) => spawnSync(process.execPath, [cliEntry, ...args], { encoding: 'utf8', timeout: 20_000 })

t.test('handoff --version and <command> --version print the package version and the runtime, exit 0', async (t) => {
  for (const args of [['--version'], ['-V'], ['router', '--version'], ['agent', '--version'], ['sim', '--version'], ['up', '--version'], ['bench', 'overhead', '--version']]) {
    const r = run(...args)
    t.equal(r.status, 0, `${args.join(' ')}: exit 0`)
    t.equal(r.stdout, `handoff ${version} (node ${process.version})\n`, `${args.join(' ')}: the version`)
  }
})

t.test('an unknown command is a usage error, whatever its name', async (t) => {
  for (const name of ['nope', 'toString', 'constructor']) {
    const r = run(name)
    t.equal(r.status, 2, `${name}: exit 2`)
    t.match(r.stderr, new RegExp(`unknown command '${name}'`), `${name}: says so`)
  }
})
