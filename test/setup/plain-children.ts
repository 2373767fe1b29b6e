/**
 * Loaded into every test process (`.taprc` node-arg), after tap's own process-info hook.
 *
 * tap hooks every spawn so that a child loads `@tapjs/processinfo` too: a module loader on a
 * second thread that every import passes through, and V8 precise coverage written out as JSON
 * at exit. A child that runs the compiled CLI (`dist/`: routers, simulators, agents, `handoff
 * up`) gains nothing from it, since `dist/**` is outside coverage (`.taprc` coverage-exclude),
 * and it made each of them start slower and spend more CPU: a suite spawns hundreds. This takes
 * the hook back out of those children's NODE_OPTIONS. Children that run TypeScript sources
 * (test/native's fixtures, the benches' forks) keep it: their coverage counts.
 */
import { join, sep } from 'node:path'
import processOnSpawn from 'process-on-spawn'
import { argvToNodeOptions, nodeOptionsToArgv } from 'node-options-to-argv'
import { packageRoot } from '../../common/paths.js'

const dist = join(packageRoot, 'dist') + sep
const processInfoHook = /[\\/]@tapjs[\\/]processinfo[\\/]/

processOnSpawn.addListener((child) => {
  if (!child.args.some((arg) => arg.startsWith(dist))) return
  const options = child.env.NODE_OPTIONS
  if (options === undefined) return
  const kept = nodeOptionsToArgv(options).filter((arg) => !processInfoHook.test(arg))
  if (kept.length > 0) child.env.NODE_OPTIONS = argvToNodeOptions(kept)
  else delete child.env.NODE_OPTIONS
})
