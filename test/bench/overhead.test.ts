import { execFile } from 'node:child_process'
import { promisify } from 'node:util'
import t from 'tap'
import { cliEntry } from '../../common/paths.js'

// A smoke run: the benchmark must keep working; its figures are not asserted (docs/benchmarks.md).
t.test('handoff bench overhead runs all three paths and reports every figure', async (t) => {
  const { stdout } = await promisify(execFile)(
    process.execPath,
    [cliEntry, 'bench', 'overhead', '--sizes', '200', '--concurrency', '1', '--requests', '20', '--seconds', '2', '--rounds', '1', '--json', '--no-overload'],
    { timeout: 90_000 },
  )
  const rows = stdout.trim().split('\n').map((l) => JSON.parse(l) as Record<string, number>)
  t.equal(rows.length, 1)
  const row = rows[0] as Record<string, number>
  t.equal(row.errors, 0, 'every request succeeded')
  for (const key of ['direct_p50_ms', 'router_p50_ms', 'bare_p50_ms', 'router_rps', 'router_cpu_s_per_1k', 'router_rss_mib']) {
    t.ok(Number.isFinite(row[key]) && (row[key] as number) > 0, `${key} measured`)
  }
})

t.test('handoff bench overhead --overload-only runs the busy-decoder case beside a direct client', async (t) => {
  const { stdout } = await promisify(execFile)(
    process.execPath,
    [cliEntry, 'bench', 'overhead', '--overload-only', '--overload-concurrency', '12', '--overload-seconds', '2', '--overload-tokens', '4'],
    { timeout: 90_000 },
  )
  const rows = stdout.split('\n').filter((l) => /^\| (direct|router) \|/.test(l))
  t.equal(rows.length, 2, 'a row per path')
  t.match(rows[1], /down in 0\/\d+ samples, 0 ejections/, "the router's view of the decoder is reported")
})
