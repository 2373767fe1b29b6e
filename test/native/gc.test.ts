// Issue #7 item 3: an agent dropped without close() was never freed: the notification callback
// captured the agent and the thread-safe function held the callback, a cycle through a GC
// root. Three dropped agents kept 7 extra threads after 10 forced collections. Now the
// callback holds the agent weakly, so a dropped agent is collected and its threads stop.
import { execFile } from 'node:child_process'
import { join } from 'node:path'
import { promisify } from 'node:util'
import t from 'tap'
import { packageRoot } from '../../common/paths.js'
import { describeNixl, needNixl, probeNixl } from './helpers.js'

const probe = await probeNixl()
const skip = needNixl(t, probe)

t.test('dropped agents are collected and their threads stop', { skip }, async (t) => {
  if (!probe.ok) return
  t.comment(describeNixl(probe.info))
  const fixture = join(packageRoot, 'test', 'native', 'fixtures', 'drop-agents.ts')
  const { stdout } = await promisify(execFile)(process.execPath, ['--expose-gc', '--import', 'tsx', fixture], {
    env: { ...process.env, NIXL_LIB_DIR: probe.info.libDir, DROP_AGENTS: '3' },
    timeout: 60_000,
  })
  const { before, alive, after } = JSON.parse(stdout.trim().split('\n').pop() ?? '{}') as {
    before: number
    alive: number
    after: number
  }
  t.comment(`threads: ${before} before, ${alive} with 3 agents, ${after} after dropping them and 10 collections`)
  t.ok(alive > before, 'each agent runs threads of its own')
  t.equal(after, before, 'no thread of a dropped agent survives')
})

// Found while fixing item 3: a process that exited with three live agents aborted (SIGABRT)
// in the agents' finalizers, which released thread-safe functions Node had already torn down.
t.test('a process that exits with live agents exits cleanly', { skip }, async (t) => {
  if (!probe.ok) return
  const fixture = join(packageRoot, 'test', 'native', 'fixtures', 'drop-agents.ts')
  const { stdout } = await promisify(execFile)(process.execPath, ['--expose-gc', '--import', 'tsx', fixture], {
    env: { ...process.env, NIXL_LIB_DIR: probe.info.libDir, DROP_AGENTS: '3', KEEP_AGENTS: '1' },
    timeout: 60_000,
  })
  t.match(stdout, /"kept":3/, 'exit status 0 with three agents alive at exit')
})
