// Shared setup for the native tests: NIXL availability (skip locally, fail under CI) and the
// target child process.
import '../helpers/ucx-hooks.js'
import { fork, spawnSync, type ChildProcess } from 'node:child_process'
import { join } from 'node:path'
import { packageRoot } from '../../common/paths.js'
import { createAgent, loadNixl, type AgentOptions, type NixlAgent, type NixlInfo } from '../../native/index.js'

export const ci = process.env.CI === 'true' || process.env.CI === '1'


export type NixlProbe = { ok: true; info: NixlInfo } | { ok: false; reason: string }

/** Loads NIXL once per test process, as the transfer agent would. */
export async function probeNixl(): Promise<NixlProbe> {
  try {
    const info = await loadNixl({ libDir: process.env.NIXL_LIB_DIR })
    return { ok: true, info }
  } catch (err) {
    const e = err as { code?: string; message?: string }
    return { ok: false, reason: `NIXL not available: ${e.code ?? ''} ${e.message ?? String(err)}` }
  }
}

interface TapLike {
  fail(message: string): void
  comment(message: string): void
}

/**
 * tap's `skip` option for tests that need NIXL: the reason on a developer machine, false when
 * NIXL is there. Under CI a missing NIXL is a failure, never a skip.
 */
export function needNixl(t: TapLike, probe: NixlProbe): string | false {
  if (probe.ok) return false
  if (ci) {
    t.fail(`${probe.reason} (CI=true requires real NIXL)`)
    return false
  }
  return probe.reason
}

export function describeNixl(info: NixlInfo): string {
  return `NIXL ${info.version ?? 'version unknown'} (${info.variant ?? 'unknown variant'}) loaded from ${info.path} [${info.source}]`
}

export interface Target {
  readonly child: ChildProcess
  readonly name: string
  call<T = Record<string, unknown>>(body: Record<string, unknown>, timeoutMs?: number): Promise<T>
  kill(): Promise<void>
}

const fixture = join(packageRoot, 'test', 'native', 'fixtures', 'target.ts')

/** Starts the target process and initializes its NIXL agent; bounded by `readyMs`. */
export async function startTarget(
  name: string,
  libDir: string,
  env: NodeJS.ProcessEnv = {},
  readyMs = 30_000,
): Promise<Target & { init: { md: string; version: string | null } }> {
  const child = fork(fixture, [], {
    execArgv: ['--import', 'tsx'],
    env: { ...process.env, ...env, NIXL_LIB_DIR: libDir, HANDOFF_NIXL_TARGET: '1' },
    stdio: ['ignore', 'inherit', 'inherit', 'ipc'],
  })
  // Request ids only need to be unique per child: each has its own pending map.
  let reqIds = 1
  const pending = new Map<number, { resolve: (v: unknown) => void; reject: (e: Error) => void }>()
  // Every way the child can end settles the calls still pending, and nothing here is a promise
  // that can reject unobserved. The previous version derived `void`ed promises from
  // events.once(child, 'exit'), which also rejects on a child 'error' event (an IPC send to a
  // child that just died emits ERR_IPC_CHANNEL_CLOSED), and a call sent to a dead child waited
  // for an exit that had already happened: under load that surfaced as an unhandled "target
  // … exited" rejection in disconnect.test.ts (router issue #6, item 9).
  let gone: Error | undefined
  const failAll = (err: Error): void => {
    gone ??= err
    for (const p of pending.values()) p.reject(gone)
    pending.clear()
  }
  const exited = new Promise<void>((resolve) => {
    child.once('exit', (code, signal) => {
      failAll(new Error(`target ${name} exited (${signal ?? code})`))
      resolve()
    })
  })
  // Without a listener an 'error' event would be thrown as an uncaught exception.
  child.on('error', (err) => failAll(err))
  child.on('message', (m: unknown) => {
    const msg = m as { reqId?: number; ok?: boolean; result?: unknown; error?: { code: string; message: string } }
    if (msg.reqId === undefined) return
    const p = pending.get(msg.reqId)
    if (!p) return
    pending.delete(msg.reqId)
    if (msg.ok) p.resolve(msg.result)
    else p.reject(Object.assign(new Error(msg.error?.message ?? 'target error'), { code: msg.error?.code }))
  })
  const call = <T>(body: Record<string, unknown>, timeoutMs = 30_000): Promise<T> => {
    if (gone) return Promise.reject(gone)
    const reqId = reqIds++
    const p = new Promise<T>((resolve, reject) => {
      pending.set(reqId, { resolve: resolve as (v: unknown) => void, reject })
    })
    child.send({ reqId, body }, (err) => {
      if (!err) return
      const entry = pending.get(reqId)
      pending.delete(reqId)
      entry?.reject(err)
    })
    return withTimeout(p, timeoutMs, `target ${name}: ${String(body.cmd)} timed out`).finally(() => pending.delete(reqId))
  }
  const kill = async (): Promise<void> => {
    if (child.exitCode === null && child.signalCode === null) child.kill('SIGKILL')
    await withTimeout(exited, 10_000, `target ${name} did not die`)
  }
  try {
    await withTimeout(
      new Promise<void>((resolve, reject) => {
        child.on('message', (m: unknown) => {
          if ((m as { ready?: boolean }).ready) resolve()
        })
        void exited.then(() => reject(new Error(`target ${name} exited before ready`)))
      }),
      readyMs,
      `target ${name} not ready`,
    )
  } catch (err) {
    await kill()
    throw err
  }
  try {
    const init = await call<{ md: string; version: string | null }>({ cmd: 'init', name }, readyMs)
    return { child, name, call, kill, init }
  } catch (err) {
    // Seen once in CI (Node 24, three files at a time): init over UCX_TLS=tcp still pending
    // after 30 s, never here alone. Where each of its threads waits says why.
    const stacks = child.pid !== undefined && child.exitCode === null ? threadStacks(child.pid) : undefined
    await kill()
    if (stacks && err instanceof Error) err.message += `\n${stacks}`
    throw err
  }
}

/** Every thread's native stack of process `pid` (gdb, where installed), shortened. */
function threadStacks(pid: number): string | undefined {
  const r = spawnSync('gdb', ['-batch', '-nx', '-p', String(pid), '-ex', 'thread apply all bt 15'], { encoding: 'utf8', timeout: 30_000 })
  if (r.error || !r.stdout) return undefined
  // Frames without their arguments and library paths, so every thread fits (the main thread,
  // Thread 1, comes last in gdb's order).
  const lines = r.stdout
    .split('\n')
    .filter((l) => /^Thread |^#/.test(l))
    .map((l) => l.replace(/ \(.*?\) (at|from) /, ' $1 ').replace(/from \S*\//, 'from '))
  return `target threads (gdb):\n${lines.join('\n').slice(-12_000)}`
}

export interface TargetNotification {
  peer: string
  message: string
}

/**
 * Polls the notifications the target has received until one carries `message`; resolves
 * with it, or with undefined once `timeoutMs` has passed.
 */
export async function waitForTargetNotification(target: Target, message: string, timeoutMs = 10_000): Promise<TargetNotification | undefined> {
  const deadline = Date.now() + timeoutMs
  for (;;) {
    const { notifications } = await target.call<{ notifications: TargetNotification[] }>({ cmd: 'notifications' })
    const hit = notifications.find((n) => n.message === message)
    if (hit || Date.now() >= deadline) return hit
    await new Promise((r) => setTimeout(r, 20))
  }
}

export function withTimeout<T>(p: Promise<T>, ms: number, what: string): Promise<T> {
  let timer: NodeJS.Timeout | undefined
  return Promise.race([
    p,
    new Promise<never>((_, reject) => {
      timer = setTimeout(() => reject(new Error(`${what} (after ${ms} ms)`)), ms)
    }),
  ]).finally(() => clearTimeout(timer))
}

/** The reader side: an agent in the test process with the UCX backend. */
export async function readerAgent(name: string, opts: AgentOptions = {}): Promise<NixlAgent> {
  const agent = await createAgent(name, opts)
  await agent.createBackend('UCX', {})
  return agent
}
