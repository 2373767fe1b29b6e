import { spawn, type ChildProcess } from 'node:child_process'
import { once } from 'node:events'
import { existsSync } from 'node:fs'
import { nodeArgsFor } from './node-args.js'
import { cliEntry } from './paths.js'
import { isReadyMessage } from './ready.js'

export interface SpawnedService {
  readonly url: string
  readonly child: ChildProcess
  /** The last lines the child wrote to stdout and stderr, for diagnostics. */
  output(): string
  /** SIGTERM, then SIGKILL after `graceMs`; resolves with the exit code or signal. */
  stop(graceMs?: number): Promise<number | NodeJS.Signals | null>
}

export interface SpawnOptions {
  /** Arguments after `handoff`, e.g. `['sim', '--role', 'prefill', '--port', '0']`. */
  args: string[]
  env?: NodeJS.ProcessEnv
  readyTimeoutMs?: number
  /** Copy the child's output to this process's stderr as it arrives. */
  inheritOutput?: boolean
  /** Keep at most this many characters of output (default 64 KiB). */
  outputLimit?: number
  /** Another build's CLI entry (a baseline to compare with); default this package's. */
  entry?: string
  /** Another Node binary to run it with (a runtime to compare with); default this process's. */
  node?: string
}

/**
 * Starts `handoff <args>` as a child process with an IPC channel and resolves once the child
 * announces the URL it serves (see ready.ts). Rejects, with the child's output, if it exits
 * or stays silent past the timeout.
 */
export async function spawnService(opts: SpawnOptions): Promise<SpawnedService> {
  const entry = opts.entry ?? cliEntry
  if (!existsSync(entry)) throw new Error(`${entry} is missing: run \`npm run build\` first`)
  const limit = opts.outputLimit ?? 65536
  let buffer = ''
  const child = spawn(opts.node ?? process.execPath, [...nodeArgsFor(opts.args[0]), entry, ...opts.args], {
    env: opts.env ?? process.env,
    stdio: ['ignore', 'pipe', 'pipe', 'ipc'],
  })
  const collect = (chunk: Buffer): void => {
    if (opts.inheritOutput) process.stderr.write(chunk)
    buffer += chunk.toString('utf8')
    if (buffer.length > limit) buffer = buffer.slice(buffer.length - limit)
  }
  child.stdout?.on('data', collect)
  child.stderr?.on('data', collect)

  const exited = once(child, 'exit') as Promise<[number | null, NodeJS.Signals | null]>
  const url = await new Promise<string>((resolve, reject) => {
    const timer = setTimeout(() => {
      child.kill('SIGKILL')
      reject(new Error(`handoff ${opts.args.join(' ')} not ready after ${opts.readyTimeoutMs ?? 45000} ms\n${buffer}`))
    }, opts.readyTimeoutMs ?? 45000)
    child.on('message', (msg) => {
      if (isReadyMessage(msg)) {
        clearTimeout(timer)
        resolve(msg.url)
      }
    })
    void exited.then(([code, signal]) => {
      clearTimeout(timer)
      reject(new Error(`handoff ${opts.args.join(' ')} exited (${code ?? signal}) before ready\n${buffer}`))
    })
  })

  return {
    url,
    child,
    output: () => buffer,
    async stop(graceMs = 5000) {
      if (child.exitCode !== null || child.signalCode !== null) return child.exitCode ?? child.signalCode
      child.kill('SIGTERM')
      const timer = setTimeout(() => child.kill('SIGKILL'), graceMs)
      const [code, signal] = await exited
      clearTimeout(timer)
      return code ?? signal
    },
  }
}
