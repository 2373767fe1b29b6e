import { execFile } from 'node:child_process'
import { promisify } from 'node:util'
import t from 'tap'
import { cliEntry } from '../../common/paths.js'
import { needRedis } from '../helpers/redis.js'

// A smoke run with tiny sizes: every path and setup gets a row, no request fails, every event
// reaches every stream (the bench throws otherwise); the figures are not asserted
// (docs/benchmarks.md).
t.test('handoff bench routers --quick: memory vs Redis routers, requests and fan-out', { skip: needRedis(t) }, async (t) => {
  const args = [cliEntry, 'bench', 'routers', '--quick', '--concurrency', '2', '--agents', '2,4', '--events', '3']
  const { stdout } = await promisify(execFile)(process.execPath, args, { timeout: 90_000 })
  t.match(stdout, /^Machine: \d+ × .+, Node v\d+.*redis-server /m, 'the machine line')
  t.match(stdout, /^\| concurrency \| path \| requests \| req\/s \|/m, 'the requests table')
  const [requests = '', fanOut = ''] = stdout.split(/^Event fan-out/m)
  const paths = requests.split('\n').filter((l) => /^\| 2 \| (direct|\([abc]\))/.test(l))
  t.equal(paths.length, 4, 'direct plus setups (a), (b) and (c)')
  for (const row of paths) {
    const cols = row.split('|').map((c) => c.trim())
    t.ok(Number(cols[3]) > 0, `${cols[2]}: requests measured`)
    t.equal(cols[10], '0', `${cols[2]}: no errors`)
  }
  t.match(requests, /^\| 2 \| \(b\) 2 routers, Redis \| \d+ \| \d+ \| [0-9.]+ \/ [0-9.]+ \| -?[0-9.]+ \| [0-9.]+× \|/m, '(b) with its ratio to (a)')
  const fan = fanOut.split('\n').filter((l) => /^\| (2|4) \| \([abc]\) .* \| 3 \|/.test(l))
  t.equal(fan.length, 6, 'a fan-out row per agent count and setup')
})
