import { spawn } from 'node:child_process'
import { join } from 'node:path'
import { packageRoot } from '../common/paths.js'

/** The engines' preStop drain, as the Helm chart mounts it into engine pods. */
export const prestopScript = join(packageRoot, 'deploy/helm/handoff/files/prestop-drain.py')

export interface HookRun {
  code: number | null
  stderr: string
  /** performance.now() when the process exited. */
  exitedAt: number
}

export interface Hook {
  done: Promise<HookRun>
  running(): boolean
  stderr(): string
}

/**
 * Runs the preStop script as the kubelet would: python3, the pod's env and nothing else of
 * ours (PATH only). `done` never rejects: a failure to start is exit code -1.
 */
export function runPrestopHook(args: string[], env: Record<string, string>): Hook {
  const child = spawn('python3', [prestopScript, ...args], { env: { PATH: process.env.PATH ?? '', ...env }, stdio: ['ignore', 'ignore', 'pipe'] })
  let stderr = ''
  child.stderr.on('data', (d: Buffer) => (stderr += d.toString()))
  let exited = false
  const done = new Promise<HookRun>((resolve) => {
    child.once('error', (err) => resolve({ code: -1, stderr: `${stderr}\n${err.message}`, exitedAt: performance.now() }))
    child.once('exit', (code) => {
      exited = true
      // stderr may still hold a last chunk: 'close' follows once the pipe is drained.
      child.once('close', () => resolve({ code, stderr, exitedAt: performance.now() }))
      if (child.stderr.closed) resolve({ code, stderr, exitedAt: performance.now() })
    })
  })
  return { done, running: () => !exited, stderr: () => stderr }
}
