import { spawnSync } from 'node:child_process'
import { existsSync, readFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { createServer } from 'node:net'
import t from 'tap'
import { freePort } from '../../common/ports.js'

t.test('freePort: a bindable port below the ephemeral range, so no client can connect to itself on it', async (t) => {
  const [low] = readFileSync('/proc/sys/net/ipv4/ip_local_port_range', 'utf8').trim().split(/\s+/).map(Number)
  const seen = new Set<number>()
  for (let i = 0; i < 20; i++) {
    const port = await freePort()
    t.ok(port >= 10_000 && port < (low as number), `${port} below ${low}`)
    seen.add(port)
    const server = createServer()
    await new Promise<void>((resolve, reject) => {
      server.once('error', reject)
      server.listen(port, '127.0.0.1', resolve)
    })
    await new Promise<void>((resolve) => server.close(() => resolve()))
  }
  t.ok(seen.size > 10, `spread over the range (${seen.size} distinct of 20)`)
})

t.test('freePort: a port handed to one process is not handed to another for a minute', async (t) => {
  const mine = new Set<number>()
  for (let i = 0; i < 200; i++) mine.add(await freePort())
  t.equal(mine.size, 200, 'never twice in one process')
  const script = `import('${new URL('../../common/ports.ts', import.meta.url).pathname}').then(async ({ freePort }) => { const out = []; for (let i = 0; i < 200; i++) out.push(await freePort()); console.log(JSON.stringify(out)) })`
  const run = spawnSync(process.execPath, [...process.execArgv, '--input-type=module', '-e', script], { encoding: 'utf8', timeout: 60_000 })
  t.equal(run.status, 0, run.stderr)
  const theirs = JSON.parse(run.stdout.trim().split('\n').at(-1) ?? '[]') as number[]
  t.equal(theirs.length, 200)
  t.same(theirs.filter((p) => mine.has(p)), [], 'another process got none of them')
})

t.test('freePort: a process that exits leaves no claim behind (issue 38: 505 files after one run)', async (t) => {
  const script = `import('${new URL('../../common/ports.ts', import.meta.url).pathname}').then(async ({ freePort }) => { const out = []; for (let i = 0; i < 5; i++) out.push(await freePort()); console.log(JSON.stringify(out)) })`
  const run = spawnSync(process.execPath, [...process.execArgv, '--input-type=module', '-e', script], { encoding: 'utf8', timeout: 60_000 })
  t.equal(run.status, 0, run.stderr)
  const ports = JSON.parse(run.stdout.trim().split('\n').at(-1) ?? '[]') as number[]
  t.equal(ports.length, 5)
  t.same(ports.filter((p) => existsSync(join(tmpdir(), 'handoff-ports', String(p)))), [], 'its claim files are gone')
  const mine = await freePort()
  t.ok(existsSync(join(tmpdir(), 'handoff-ports', String(mine))), 'while a live process holds its claim')
})
