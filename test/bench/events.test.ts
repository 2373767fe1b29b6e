import { execFile } from 'node:child_process'
import { promisify } from 'node:util'
import t from 'tap'
import { cliEntry } from '../../common/paths.js'

// A smoke run of the control-plane bench: every event reaches every stream (the bench throws
// otherwise) and both tables print; the figures are not asserted (docs/benchmarks.md).
t.test('handoff bench events --quick: fan-out to 1, 10 and 100 streams, selection at 10, 1,000 and 10,000 instances, ledger memory', async (t) => {
  const { stdout } = await promisify(execFile)(process.execPath, [cliEntry, 'bench', 'events', '--quick'], { timeout: 90_000 })
  const fanOut = stdout.split('\n').filter((l) => /^\| (1|10|100) \| 20 \|/.test(l))
  t.equal(fanOut.length, 3, 'a fan-out row per agent count')
  // The bench throws when a pick finds no P/D route or falls back to the scan.
  const selection = stdout.split('\n').filter((l) => /^\| (10|1,000|10,000) \| (all|label) \| [0-9.]+ \| [0-9.]+ \| [0-9.]+x \|$/.test(l))
  t.equal(selection.length, 6, 'a selection row per size and pairing mode, the scan beside the candidate lists')
  t.match(stdout, /^\| 10,000 \| [0-9.]+ \| [0-9]+ \|$/m, 'the ledger memory row')
})
