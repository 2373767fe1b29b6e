import { type ChildProcess, spawn, spawnSync } from 'node:child_process'
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { connect } from 'node:net'
import { setTimeout as sleep } from 'node:timers/promises'
import { freePort } from '../../common/ports.js'
import type { Teardown } from './cluster.js'
import { missing } from './need.js'

/**
 * tap's `skip` for tests that need Redis: the reason on a machine without `redis-server`,
 * false when it is there. Under CI a missing Redis is a failure, never a skip.
 */
export function needRedis(t: { fail(message: string): void }): string | false {
  if (spawnSync('redis-server', ['--version'], { stdio: 'ignore' }).status === 0) return false
  return missing(t, 'redis-server not found (Debian: apt-get install redis-server)')
}

/**
 * A real `redis-server` on a free loopback port, killed when the test ends (issue 10: nothing
 * is mocked). Debian's package; `.ci/run` installs it. Nothing is persisted unless a test
 * asks for a snapshot (`SAVE`): a restart then loads the last one, as Redis restarted from an
 * older RDB does (issue 21 item 2).
 */
export interface LocalRedis {
  port: number
  url: string
  /** Kills the server now (a Redis outage, no shutdown save); `start` brings one back on the same port, from the last SAVE if any. */
  stop(): Promise<void>
  start(): Promise<void>
  /** Drops the last snapshot: the next start is empty. */
  forgetSnapshot(): void
}

/**
 * `replicaOf`: a replica of the server at that port (for Sentinel, issue 21 item 7). `sentinel`:
 * a sentinel (the same binary, `--sentinel`) watching the master at that port as `mymaster`,
 * quorum 1, down after 1 s: Sentinel rewrites its config file, which lives in a temp folder.
 */
export async function startRedis(t: Teardown, opts: { replicaOf?: number; sentinel?: number } = {}): Promise<LocalRedis> {
  const port = await freePort()
  const dir = mkdtempSync(join(tmpdir(), 'handoff-redis-'))
  t.teardown(() => rmSync(dir, { recursive: true, force: true }))
  let args = ['--port', String(port), '--bind', '127.0.0.1', '--save', '', '--appendonly', 'no', '--dir', dir]
  if (opts.replicaOf !== undefined) args.push('--replicaof', '127.0.0.1', String(opts.replicaOf))
  if (opts.sentinel !== undefined) {
    const conf = join(dir, 'sentinel.conf')
    writeFileSync(
      conf,
      [
        `port ${port}`,
        'bind 127.0.0.1',
        `dir ${dir}`,
        `sentinel monitor mymaster 127.0.0.1 ${opts.sentinel} 1`,
        'sentinel down-after-milliseconds mymaster 1000',
        'sentinel failover-timeout mymaster 5000',
        '',
      ].join('\n'),
    )
    args = [conf, '--sentinel']
  }
  let child: ChildProcess | undefined
  const stop = async (): Promise<void> => {
    const c = child
    child = undefined
    if (!c || c.exitCode !== null) return
    const exited = new Promise((resolve) => c.once('exit', resolve))
    c.kill('SIGKILL')
    await exited
  }
  const start = async (): Promise<void> => {
    const c = spawn('redis-server', args, { stdio: ['ignore', 'ignore', 'pipe'] })
    child = c
    let stderr = ''
    c.stderr?.on('data', (d: Buffer) => (stderr += d.toString()))
    const failed = new Promise<never>((_, reject) => {
      c.once('error', reject)
      c.once('exit', (code) => reject(new Error(`redis-server exited with ${code}: ${stderr}`)))
    })
    failed.catch(() => {})
    const deadline = Date.now() + 10_000
    while (!(await Promise.race([ping(port), failed]))) {
      if (Date.now() > deadline) throw new Error(`redis-server on port ${port} did not answer PING`)
      await sleep(25)
    }
  }
  await start()
  t.teardown(stop)
  return { port, url: `redis://127.0.0.1:${port}`, stop, start, forgetSnapshot: () => rmSync(join(dir, 'dump.rdb'), { force: true }) }
}

/** One raw PING; true on +PONG. */
function ping(port: number): Promise<boolean> {
  return new Promise((resolve) => {
    const sock = connect(port, '127.0.0.1')
    let data = ''
    const done = (ok: boolean): void => {
      sock.destroy()
      resolve(ok)
    }
    sock.setTimeout(500, () => done(false))
    sock.once('error', () => done(false))
    sock.on('data', (d) => {
      data += d.toString()
      if (data.includes('\r\n')) done(data.startsWith('+PONG'))
    })
    sock.write('PING\r\n')
  })
}
