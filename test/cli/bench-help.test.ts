import { spawnSync } from 'node:child_process'
import t from 'tap'
import { cliEntry } from '../../common/paths.js'

/* `handoff bench <name> --help` prints its usage and runs nothing; an unknown bench or flag is refused. */

const bench = (...args: string[]) => spawnSync(process.execPath, [cliEntry, 'bench', ...args], { encoding: 'utf8', timeout: 20_000 })

for (const name of ['overhead', 'nixl', 'agent', 'events', 'real', 'connector', 'routers']) {
  t.test(`bench ${name} --help`, async (t) => {
    const run = bench(name, '--help')
    t.equal(run.status, 0, run.stderr)
    t.match(run.stdout, new RegExp(`^usage: handoff bench ${name} `), 'prints its usage')
    // A run reports its progress on stderr and prints a results table: --help ran nothing.
    // (Behaviour, not time: a loaded 2-core machine made a wall-clock bound fail.)
    t.equal(run.stderr, '', 'nothing ran: no progress lines')
    t.notMatch(run.stdout, /\n\|/, 'and no results table')
  })
}

t.test('an unknown bench: exit 2 with the list', async (t) => {
  const run = bench('nope')
  t.equal(run.status, 2)
  t.match(run.stdout, /usage: handoff bench <overhead\|nixl\|agent\|events\|real\|connector\|routers/)
})

t.test('an unknown flag is refused, not ignored', async (t) => {
  const run = bench('nixl', '--bogus')
  t.not(run.status, 0)
  t.match(run.stderr, /Unknown option '--bogus'/)
})
