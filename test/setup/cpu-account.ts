/**
 * Loaded into every test process (`.taprc` node-arg). With HANDOFF_TEST_CPU_LOG set, each test
 * file appends one JSON line at exit: its own CPU seconds and those of the children it reaped
 * (routers, simulators, agents, engines; Linux's cutime/cstime), and its wall time. Wall times
 * of files that run three at a time say little about where the CPU goes; this does
 * (docs/testing.md). Off, it costs one environment lookup.
 */
import { appendFileSync, readFileSync } from 'node:fs'
import { relative } from 'node:path'
import { packageRoot } from '../../common/paths.js'

const logFile = process.env.HANDOFF_TEST_CPU_LOG
const file = process.argv[1] ?? ''

if (logFile && file.endsWith('.test.ts')) {
  process.on('exit', () => {
    try {
      // /proc/self/stat: fields after the command's ')' start at field 3; utime is field 14.
      const stat = readFileSync('/proc/self/stat', 'utf8')
      const fields = stat.slice(stat.lastIndexOf(')') + 2).split(' ')
      // In clock ticks: 100 per second on Linux (USER_HZ).
      const seconds = (field: number): number => Number(fields[field - 3]) / 100
      const line = {
        file: relative(packageRoot, file),
        selfCpuS: seconds(14) + seconds(15),
        childrenCpuS: seconds(16) + seconds(17),
        wallS: Math.round(process.uptime() * 10) / 10,
      }
      appendFileSync(logFile, JSON.stringify(line) + '\n')
    } catch {
      // Not Linux, or the log cannot be written: an accounting aid, never a test failure.
    }
  })
}
