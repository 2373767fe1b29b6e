import { spawn } from 'node:child_process'
import { once } from 'node:events'
import { existsSync, mkdtempSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import t from 'tap'
import { cliEntry } from '../../common/paths.js'
import { oracleForBody } from '../../sim/src/oracle.js'
import { get, post, waitFor } from '../helpers/cluster.js'
import { needRedis } from '../helpers/redis.js'
import { alive, args, childPids, environ, listenerPid, startUp } from '../helpers/up.js'
import { needNixl, probeNixl } from '../native/helpers.js'

/* `handoff up --routers N --store …` (issue 10): several routers on one Redis, and what it refuses. */

const nixl = await probeNixl()

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

t.test('handoff up --routers 2 --store redis: a router or the Redis that dies is started again at its port, and the rest serves meanwhile (issue 21 item 8)', { skip: needRedis(t) }, async (t) => {
  const ADMIN = 'admin-token-up-restarts'
  const admin = { authorization: `Bearer ${ADMIN}` }
  const second = /handoff up: router 2 at (http:\/\/127\.0\.0\.1:\d+)\n/
  const { proc: up, out, url } = await startUp(t, ['--prefill', '0', '--decode', '1', '--port', '0', '--kv', 'none', '--routers', '2', '--store', 'redis', '--admin-token', ADMIN], {}, second)
  t.ok(url, 'ready', { output: out() })
  if (!url) return
  const url2 = second.exec(out())?.[1] as string
  const completion = { model: 'handoff/sim-1', prompt: 'Once upon a time', max_tokens: 5 }
  const serves = async (u: string): Promise<boolean> => {
    try {
      return (await post(`${u}/v1/completions`, completion)).json<{ choices: { text: string }[] }>().choices[0]?.text === oracleForBody('/v1/completions', completion)
    } catch {
      return false
    }
  }
  const routerPid = (u: string): number | undefined => listenerPid(Number(new URL(u).port), childPids(up.pid))

  // Router 2 is killed outright: router 1 serves on, and router 2 comes back at its port.
  const pid2 = routerPid(url2)
  t.ok(pid2, 'router 2 is a child')
  process.kill(pid2 as number, 'SIGKILL')
  t.ok(await serves(url), 'router 1 serves while router 2 is down')
  t.ok(await waitFor(() => /router 2 is back at /.test(out()), 20_000), 'router 2 is started again', { output: out() })
  t.match(out(), /handoff up: router 2 exited \(SIGKILL\); starting it again \(restart 1 of 5\)/, 'stderr says which child exited, how, and that it restarts')
  t.ok(await serves(url2), 'router 2 serves again at its URL')
  t.not(routerPid(url2), pid2, 'a new process')

  // An event logged, then the local Redis killed outright: it comes back from its append-only
  // file (a second after the write: appendfsync everysec), so the event is still there.
  t.equal((await post(`${url}/v1/agents`, { agentId: 'ghost', engineId: 'ghost-engine', role: 'prefill', agentUrl: 'http://127.0.0.1:5999' })).status, 200)
  const logged = (await post(`${url}/fault_tolerance/event`, { event_type: 'peer_gone', nodes: { engine_ids: ['ghost-engine'] } }, admin)).json<{ seq: number; log_id: string }>()
  t.equal(logged.seq, 1)
  await new Promise((r) => setTimeout(r, 1500))
  const wrapper = childPids(up.pid).find((p) => /^sh /.test(args(p))) as number
  const redisPid = childPids(wrapper).find((p) => /^redis-server /.test(args(p)))
  t.ok(redisPid, 'redis-server runs under its wrapper')
  process.kill(redisPid as number, 'SIGKILL')
  t.ok(await waitFor(() => /the local redis-server is back at /.test(out()), 20_000), 'the local Redis is started again', { output: out() })
  t.equal(up.exitCode, null, 'the cluster keeps running')
  const after = await waitFor(async () => (await get(`${url2}/fault_tolerance/events/1?log=${logged.log_id}`, admin)).status === 200, 15_000)
  t.ok(after, 'the event is in the same log after the restart (read through the other router)')
  t.ok(await serves(url) && (await serves(url2)), 'both routers serve')

  const pids = childPids(up.pid)
  up.kill('SIGTERM')
  const [code] = (await once(up, 'exit')) as [number | null]
  t.equal(code, 0)
  t.ok(await waitFor(() => pids.every((pid) => !alive(pid)), 10000), 'no child left behind')
  const dir = /its append-only file in (\S+)\)/.exec(out())?.[1]
  t.ok(dir && !existsSync(dir), "the local Redis's folder is removed")
})
