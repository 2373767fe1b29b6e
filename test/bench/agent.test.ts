import { execFile } from 'node:child_process'
import { promisify } from 'node:util'
import t from 'tap'
import { cliEntry } from '../../common/paths.js'
import { needNixl, probeNixl } from '../native/helpers.js'

// A smoke run: two agents, a lease, a pull and P's lease_ended per handoff, beside the raw
// READ; the figures are not asserted (docs/benchmarks.md).
const probe = await probeNixl()

t.test('handoff bench agent --quick prints both tables with every handoff done and verified', { skip: needNixl(t, probe) }, async (t) => {
  const { stdout, stderr } = await promisify(execFile)(process.execPath, [cliEntry, 'bench', 'agent', '--quick', '--seconds', '1'], { timeout: 60_000 })
  t.match(stdout, /^\| prompt tokens \| request \| concurrency \| handoffs \|/m, 'the comparison table')
  t.match(stdout, /^\| prompt tokens \| concurrency \| lease call p50/m, 'the breakdown table')
  const rows = stdout.split('\n').filter((l) => /^\| 1024 \| 64 × 64 KiB/.test(l))
  t.equal(rows.length, 2, 'a row per concurrency')
  for (const row of rows) {
    const cols = row.split('|').map((c) => c.trim())
    t.equal(cols[9], 'yes', 'bytes verified')
    t.equal(cols[10], '0', 'no failed handoff or READ')
    t.ok(Number(cols[4]) > 0, 'handoffs measured')
  }
  t.notMatch(stdout + stderr, /error:|failed handoffs/i, 'no error reported')
})
