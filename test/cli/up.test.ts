import { execFileSync, spawn, type ChildProcessByStdio } from 'node:child_process'
import { once } from 'node:events'
import { mkdtempSync, readFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import type { Readable } from 'node:stream'
import t from 'tap'
import { cliEntry } from '../../common/paths.js'
import { oracleForBody } from '../../sim/src/oracle.js'
import { get, post, streamedText, waitFor, type Teardown } from '../helpers/cluster.js'
import { needRedis } from '../helpers/redis.js'
import { needNixl, probeNixl } from '../native/helpers.js'

const nixl = await probeNixl()

function alive(pid: number): boolean {
  try {
    process.kill(pid, 0)
    return true
  } catch {
    return false
  }
}

/** The direct children of a process (pgrep -P); none is an empty list. */
function childPids(pid: number | undefined): number[] {
  try {
    return execFileSync('pgrep', ['-P', String(pid)]).toString().trim().split('\n').map(Number)
  } catch {
    return []
  }
}

/** A process's environment, from /proc (Linux). */
function environ(pid: number): Record<string, string> {
  const entries = readFileSync(`/proc/${pid}/environ`, 'utf8').split('\0').filter(Boolean)
  return Object.fromEntries(entries.map((e) => [e.slice(0, e.indexOf('=')), e.slice(e.indexOf('=') + 1)]))
}

function args(pid: number): string {
  try {
    return execFileSync('ps', ['-o', 'args=', '-p', String(pid)]).toString().trim()
  } catch {
    return ''
  }
}

interface Up {
  proc: ChildProcessByStdio<null, Readable, Readable>
  /** stdout and stderr together, and stdout alone, as far as they have come. */
  out(): string
  stdout(): string
  /** The ready line's URL; undefined when none came within the wait. */
  url: string | undefined
}

/** Runs `handoff up <args>` and waits (bounded) for its ready line; SIGKILLed when the test ends. */
async function startUp(t: Teardown, args: string[], env: NodeJS.ProcessEnv = {}, readyFor = /handoff ready/): Promise<Up> {
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

for (const mode of [
  { kv: 'none', env: {}, children: 3, says: /.*/ },
  // `auto` with NIXL here: every simulator gets its agent.
  { kv: 'auto', env: {}, children: 5, says: /KV moves through transfer agents/ },
  // `auto` (npm start's default) with NIXL pointed at an empty folder: says so and falls back.
  { kv: 'auto', env: { NIXL_LIB_DIR: mkdtempSync(join(tmpdir(), 'no-nixl-')) }, children: 3, says: /falling back to --kv none/ },
] as const) {
t.test(`handoff up --kv ${mode.kv}${mode.children === 5 ? ' (NIXL here)' : ''} serves oracle text through the router and stops every child on SIGTERM`, { skip: mode.children === 5 ? needNixl(t, nixl) : false }, async (t) => {
  const { proc: up, out, stdout, url } = await startUp(t, ['--prefill', '1', '--decode', '1', '--port', '0', '--kv', mode.kv], mode.env)
  t.ok(url, 'ready line printed', { output: out() })
  if (!url) return
  t.match(stdout(), /^handoff ready http:\/\/127\.0\.0\.1:\d+\n$/, 'stdout is exactly the ready line')

  const chat = { model: 'handoff/sim-1', messages: [{ role: 'user', content: 'What is P/D?' }], max_tokens: 10 }
  const c = await post(`${url}/v1/chat/completions`, chat)
  t.equal(c.json<{ choices: { message: { content: string } }[] }>().choices[0]?.message.content, oracleForBody('/v1/chat/completions', chat))
  const s = await post(`${url}/v1/chat/completions`, { ...chat, stream: true })
  t.equal(streamedText(s.text), oracleForBody('/v1/chat/completions', chat))
  const completion = { model: 'handoff/sim-1', prompt: 'Once upon a time', max_tokens: 7 }
  const x = await post(`${url}/v1/completions`, completion)
  t.equal(x.json<{ choices: { text: string }[] }>().choices[0]?.text, oracleForBody('/v1/completions', completion))
  t.equal((await get(`${url}/ready`)).status, 200)

  // Every child of `up` is a handoff process; collect their pids before stopping.
  const pids = childPids(up.pid)
  t.equal(pids.length, mode.children, mode.children === 5 ? 'two simulators, their agents and a router' : 'two simulators and a router')
  if (mode.kv !== 'none') t.match(out(), mode.says, 'stderr says which KV mode it chose and why')
  up.kill('SIGTERM')
  const [code] = (await once(up, 'exit')) as [number | null]
  t.equal(code, 0)
  t.ok(await waitFor(() => pids.every((pid) => !alive(pid)), 5000), 'no child left behind')
})
}

t.test('handoff up rejects bad flags clearly', async (t) => {
  const run = spawn(process.execPath, [cliEntry, 'up', '--decode', '0'], { stdio: ['ignore', 'pipe', 'pipe'] })
  let err = ''
  run.stderr.on('data', (c: Buffer) => (err += c.toString()))
  const [code] = (await once(run, 'exit')) as [number | null]
  t.equal(code, 1)
  t.match(err, /at least one --decode or --both/)
})

// Where Redis is installed (always under CI) the cluster runs a local redis-server too, which
// has no IPC channel: its wrapper must see its stdin close instead.
const redisHere = needRedis(t) === false
t.test(`children of a killed handoff up${redisHere ? ' (and its redis-server)' : ''} shut themselves down`, async (t) => {
  const { proc: up, url } = await startUp(t, ['--prefill', '1', '--decode', '1', '--port', '0', '--kv', 'none', ...(redisHere ? ['--store', 'redis'] : [])])
  t.ok(url, 'ready')
  if (!url) return
  const pids = childPids(up.pid)
  t.equal(pids.length, redisHere ? 4 : 3)
  const redis = pids.flatMap((p) => childPids(p)).filter((p) => /^redis-server /.test(args(p)))
  t.equal(redis.length, redisHere ? 1 : 0, 'a redis-server with --store redis')
  // SIGKILL gives up no chance to stop its children; their IPC channel closing must.
  up.kill('SIGKILL')
  await once(up, 'exit')
  t.ok(await waitFor(() => [...pids, ...redis].every((pid) => !alive(pid)), 10000), 'no orphan left behind')
})

t.test('handoff up --help documents --routers and --store', async (t) => {
  const help = execFileSync(process.execPath, [cliEntry, 'up', '--help']).toString()
  t.match(help, /\[--routers R\] \[--store memory\|redis\|redis:\/\/HOST:PORT\]/)
  t.match(help, /^--routers R {2}R router replicas/m)
  t.match(help, /^--store S {4}the routers' store/m)
})

t.test('handoff up refuses several routers without a shared store, and says how to get redis-server', async (t) => {
  const cases: { argv: string[]; env?: NodeJS.ProcessEnv; says: RegExp }[] = [
    { argv: ['--routers', '2'], says: /--routers 2 needs a store the routers share: --store redis .* or --store redis:\/\/HOST:PORT/ },
    { argv: ['--routers', '3', '--store', 'memory'], says: /--routers 3 needs a store the routers share/ },
    { argv: ['--routers', '0'], says: /--routers must be an integer from 1 to 16, got '0'/ },
    { argv: ['--routers', '17', '--store', 'redis'], says: /--routers must be an integer from 1 to 16, got '17'/ },
    { argv: ['--store', 'mongodb://x'], says: /--store must be memory, redis or a redis:\/\/ URL, got 'mongodb:\/\/x'/ },
    // An empty PATH folder: no redis-server to run (children would be started by absolute path).
    { argv: ['--store', 'redis'], env: { PATH: mkdtempSync(join(tmpdir(), 'no-redis-')) }, says: /redis-server, which is not installed \(Debian\/Ubuntu: apt-get install redis-server\)/ },
  ]
  await Promise.all(
    cases.map(async (c) => {
      const run = spawn(process.execPath, [cliEntry, 'up', '--kv', 'none', '--port', '0', ...c.argv], { stdio: ['ignore', 'pipe', 'pipe'], env: { ...process.env, ...c.env } })
      t.teardown(() => {
        if (run.exitCode === null) run.kill('SIGKILL')
      })
      let err = ''
      let out = ''
      run.stderr.on('data', (d: Buffer) => (err += d.toString()))
      run.stdout.on('data', (d: Buffer) => (out += d.toString()))
      // 'close', not 'exit': stderr is read to its end.
      const [code] = (await once(run, 'close')) as [number | null]
      t.equal(code, 1, `${c.argv.join(' ')}: exit 1`)
      t.match(err, c.says, `${c.argv.join(' ')}: says why`)
      t.equal(out, '', `${c.argv.join(' ')}: no ready line`)
      t.same(childPids(run.pid), [], `${c.argv.join(' ')}: started nothing`)
    }),
  )
})

t.test('handoff up --routers 2 --store redis: two routers on a local redis-server, both serve; SIGTERM stops all, Redis too', { skip: needRedis(t) }, async (t) => {
  const second = /handoff up: router 2 at (http:\/\/127\.0\.0\.1:\d+)\n/
  const { proc: up, out, stdout, url } = await startUp(t, ['--prefill', '0', '--decode', '1', '--port', '0', '--kv', 'none', '--routers', '2', '--store', 'redis'], {}, second)
  t.ok(url, 'ready line and the second router printed', { output: out() })
  if (!url) return
  t.match(stdout(), /^handoff ready http:\/\/127\.0\.0\.1:\d+\n$/, 'stdout is exactly the ready line, naming the first router')
  const url2 = second.exec(out())?.[1] as string
  t.not(url2, url, 'the second router has its own port')
  const redisUrl = /handoff up: store (redis:\/\/127\.0\.0\.1:\d+) \(a local redis-server/.exec(out())?.[1]
  t.ok(redisUrl, 'stderr names the local store')

  const completion = { model: 'handoff/sim-1', prompt: 'Once upon a time', max_tokens: 7 }
  for (const u of [url, url2]) {
    const x = await post(`${u}/v1/completions`, completion)
    t.equal(x.json<{ choices: { text: string }[] }>().choices[0]?.text, oracleForBody('/v1/completions', completion), `${u} answers`)
  }

  // Children: the redis-server wrapper, a simulator, two routers. Every router has the store.
  const pids = childPids(up.pid)
  t.equal(pids.length, 4, 'Redis, a simulator and two routers')
  const routers = pids.filter((p) => / router /.test(args(p)))
  t.equal(routers.length, 2, 'two routers')
  for (const p of routers) t.equal(environ(p).HANDOFF_STORE, redisUrl, 'the router runs on the local Redis')
  const wrapper = pids.find((p) => /^sh /.test(args(p))) as number
  const redis = childPids(wrapper).filter((p) => /^redis-server /.test(args(p)))
  t.equal(redis.length, 1, 'redis-server runs under its wrapper')

  up.kill('SIGTERM')
  const [code] = (await once(up, 'exit')) as [number | null]
  t.equal(code, 0)
  t.ok(await waitFor(() => [...pids, ...redis].every((pid) => !alive(pid)), 5000), 'no child left behind, redis-server included')
})

t.test('handoff up --routers 2 --kv agent: every agent follows both routers, the first first', { skip: needNixl(t, nixl) || needRedis(t) }, async (t) => {
  const second = /handoff up: router 2 at (http:\/\/127\.0\.0\.1:\d+)\n/
  const { proc: up, out, url } = await startUp(t, ['--prefill', '1', '--decode', '1', '--port', '0', '--kv', 'agent', '--routers', '2', '--store', 'redis'], {}, second)
  t.ok(url, 'ready', { output: out() })
  if (!url) return
  const url2 = second.exec(out())?.[1] as string
  const agents = [...out().matchAll(/ {2}agent (http:\/\/\S+)\n/g)].map((m) => m[1] as string)
  t.equal(agents.length, 2, 'stderr lists an agent beside each simulator')
  for (const a of agents) {
    const status = (await get(`${a}/v1/status`)).json<{ router: { urls: string[] } | null }>()
    t.same(status.router?.urls, [url, url2], `${a} has both router URLs, the first router first`)
  }
  // KV still moves P → D through the agents, whichever router takes the request.
  const chat = { model: 'handoff/sim-1', messages: [{ role: 'user', content: 'What is P/D?' }], max_tokens: 10 }
  const c = await post(`${url2}/v1/chat/completions`, chat)
  t.equal(c.json<{ choices: { message: { content: string } }[] }>().choices[0]?.message.content, oracleForBody('/v1/chat/completions', chat))
  const pids = childPids(up.pid)
  up.kill('SIGTERM')
  const [code] = (await once(up, 'exit')) as [number | null]
  t.equal(code, 0)
  t.ok(await waitFor(() => pids.every((pid) => !alive(pid)), 10000), 'no child left behind')
})
