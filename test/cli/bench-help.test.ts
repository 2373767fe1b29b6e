import { spawnSync } from 'node:child_process'
import t from 'tap'
import { cliEntry } from '../../common/paths.js'

/* `handoff bench <name> --help` prints its usage and runs nothing; an unknown bench or flag is refused. */

const bench = (...args: string[]) => spawnSync(process.execPath, [cliEntry, 'bench', ...args], { encoding: 'utf8', timeout: 20_000 })

for (const name of ['overhead', 'nixl', 'agent', 'events', 'routers']) {
  t.test(`bench ${name} --help`, async (t) => {
    const started = performance.now()
    const run = bench(name, '--help')
    t.equal(run.status, 0, run.stderr)
    t.match(run.stdout, new RegExp(`^usage: handoff bench ${name} `), 'prints its usage')
    // A run would take seconds to minutes and start processes; --help answers at once.
    t.ok(performance.now() - started < 10_000, `and returns without running (${Math.round(performance.now() - started)} ms)`)
  })
}

t.test('an unknown bench: exit 2 with the list', async (t) => {
  const run = bench('nope')
  t.equal(run.status, 2)
  t.match(run.stdout, /usage: handoff bench <overhead\|nixl\|agent\|events\|routers/)
})

t.test('an unknown flag is refused, not ignored', async (t) => {
  const run = bench('nixl', '--bogus')
  t.not(run.status, 0)
  t.match(run.stderr, /Unknown option '--bogus'/)
})
