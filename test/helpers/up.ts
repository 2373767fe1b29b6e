import { execFileSync, spawn, type ChildProcessByStdio } from 'node:child_process'
import { readdirSync, readFileSync, readlinkSync } from 'node:fs'
import type { Readable } from 'node:stream'
import { cliEntry } from '../../common/paths.js'
import { waitFor, type Teardown } from './cluster.js'

/* `handoff up` as its tests see it (test/cli/up*.test.ts): a real process tree, read through /proc and ps. */

export function alive(pid: number): boolean {
  try {
    process.kill(pid, 0)
    return true
  } catch {
    return false
  }
}

/** The direct children of a process (pgrep -P); none is an empty list. */
export function childPids(pid: number | undefined): number[] {
  try {
    return execFileSync('pgrep', ['-P', String(pid)]).toString().trim().split('\n').map(Number)
  } catch {
    return []
  }
}

/** A process's environment, from /proc (Linux). */
export function environ(pid: number): Record<string, string> {
  const entries = readFileSync(`/proc/${pid}/environ`, 'utf8').split('\0').filter(Boolean)
  return Object.fromEntries(entries.map((e) => [e.slice(0, e.indexOf('=')), e.slice(e.indexOf('=') + 1)]))
}

export function args(pid: number): string {
  try {
    return execFileSync('ps', ['-o', 'args=', '-p', String(pid)]).toString().trim()
  } catch {
    return ''
  }
}

export interface Up {
  proc: ChildProcessByStdio<null, Readable, Readable>
  /** stdout and stderr together, and stdout alone, as far as they have come. */
  out(): string
  stdout(): string
  /** The ready line's URL; undefined when none came within the wait. */
  url: string | undefined
}

/** Runs `handoff up <args>` and waits (bounded) for its ready line; SIGKILLed when the test ends. */
export async function startUp(t: Teardown, args: string[], env: NodeJS.ProcessEnv = {}, readyFor = /handoff ready/): Promise<Up> {
  const proc = spawn(process.execPath, [cliEntry, 'up', ...args], { stdio: ['ignore', 'pipe', 'pipe'], env: { ...process.env, ...env } })
  t.teardown(() => {
    if (proc.exitCode === null) proc.kill('SIGKILL')
  })
  let out = ''
  let stdout = ''
  proc.stdout.on('data', (c: Buffer) => {
    out += c.toString()
    stdout += c.toString()
  })
  proc.stderr.on('data', (c: Buffer) => (out += c.toString()))
  const ready = await waitFor(() => /handoff ready http:\/\/127\.0\.0\.1:\d+\n/.test(out) && readyFor.test(out), 60000)
  return { proc, out: () => out, stdout: () => stdout, url: ready ? /handoff ready (\S+)/.exec(out)?.[1] : undefined }
}

/** Which of `pids` listens on TCP `port` (from /proc/net/tcp and each process's open sockets; Linux). */
export function listenerPid(port: number, pids: number[]): number | undefined {
  const inodes = new Set<string>()
  for (const table of ['/proc/net/tcp', '/proc/net/tcp6']) {
    let text = ''
    try {
      text = readFileSync(table, 'utf8')
    } catch {
      continue
    }
    for (const line of text.trim().split('\n').slice(1)) {
      const f = line.trim().split(/\s+/)
      // local_address is ADDR:PORT in hex; st 0A is LISTEN; the inode is the tenth field.
      if (f[3] === '0A' && parseInt(f[1]?.split(':')[1] ?? '', 16) === port && f[9]) inodes.add(f[9])
    }
  }
  return pids.find((pid) => {
    try {
      return readdirSync(`/proc/${pid}/fd`).some((fd) => {
        try {
          return inodes.has(/^socket:\[(\d+)\]$/.exec(readlinkSync(`/proc/${pid}/fd/${fd}`))?.[1] ?? '')
        } catch {
          return false
        }
      })
    } catch {
      return false
    }
  })
}
