import { readFileSync } from 'node:fs'

// Linux reports process CPU time in clock ticks; USER_HZ is 100 on every mainstream kernel.
const TICKS_PER_SECOND = 100

/** CPU seconds (user + system) a process has used so far, from /proc/<pid>/stat. */
export function cpuSeconds(pid: number): number {
  const stat = readFileSync(`/proc/${pid}/stat`, 'utf8')
  // Fields after the command name (which may contain spaces) start after the last ')'.
  const fields = stat.slice(stat.lastIndexOf(')') + 2).split(' ')
  return (Number(fields[11]) + Number(fields[12])) / TICKS_PER_SECOND
}

/** Resident set size in MiB, from /proc/<pid>/status. */
export function rssMiB(pid: number): number {
  const status = readFileSync(`/proc/${pid}/status`, 'utf8')
  const m = /^VmRSS:\s+(\d+) kB/m.exec(status)
  return m ? Number(m[1]) / 1024 : Number.NaN
}
