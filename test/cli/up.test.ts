import { execFileSync, spawn } from 'node:child_process'
import { once } from 'node:events'
import { mkdtempSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import t from 'tap'
import { cliEntry } from '../../common/paths.js'
import { oracleForBody } from '../../sim/src/oracle.js'
import { get, post, streamedText, waitFor } from '../helpers/cluster.js'
import { needRedis } from '../helpers/redis.js'
import { alive, args, childPids, startUp } from '../helpers/up.js'
import { needNixl, probeNixl } from '../native/helpers.js'

const nixl = await probeNixl()

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

t.test('handoff up --lease-seconds and the block flags: one lease length for engines, agents and the router', async (t) => {
  const { proc: up, url } = await startUp(t, ['--prefill', '1', '--decode', '1', '--port', '0', '--kv', 'none', '--lease-seconds', '7', '--admin-token', 'admin-token-up-1', '--block-size', '32', '--num-gpu-blocks-override', '4096'])
  t.ok(url, 'ready')
  if (!url) return
  const leases = (await get(`${url}/leases`, { authorization: 'Bearer admin-token-up-1' })).json<{ leaseSeconds: number }>()
  t.equal(leases.leaseSeconds, 7, "the router's ledger judges leases of the engines' length")
  const sims = childPids(up.pid).map(args).filter((a) => / sim /.test(a))
  t.equal(sims.length, 2)
  t.ok(sims.every((a) => /--lease-seconds 7/.test(a)), 'and so do the simulators')
  t.ok(sims.every((a) => /--block-size 32 --num-gpu-blocks-override 4096/.test(a)), "vLLM's block flags reach the simulators")
  // --kv-events on (the default): the simulators publish, the router follows each of them.
  t.ok(sims.every((a) => /--kv-events-config /.test(a)), 'every simulator publishes its KV events')
  const prompt = Array.from({ length: 80 }, (_, i) => `word${i}`).join(' ')
  t.equal((await post(`${url}/v1/completions`, { model: 'handoff/sim-1', prompt, max_tokens: 2 })).status, 200)
  const indexed = async (): Promise<boolean> => /^handoff_router_kv_index_blocks\{instance="prefill-0"\} [1-9]/m.test((await get(`${url}/metrics`)).text)
  t.ok(await waitFor(indexed), "the router indexed the prompt's blocks on prefill-0 from its events")
  up.kill('SIGTERM')
  await once(up, 'exit')
})

t.test('handoff up rejects bad flags clearly', async (t) => {
  const run = spawn(process.execPath, [cliEntry, 'up', '--decode', '0'], { stdio: ['ignore', 'pipe', 'pipe'] })
  let err = ''
  run.stderr.on('data', (c: Buffer) => (err += c.toString()))
  const [code] = (await once(run, 'exit')) as [number | null]
  t.equal(code, 1)
  t.match(err, /at least one --decode or --both/)
  const events = spawn(process.execPath, [cliEntry, 'up', '--kv-events', 'maybe'], { stdio: ['ignore', 'pipe', 'pipe'] })
  let said = ''
  events.stderr.on('data', (c: Buffer) => (said += c.toString()))
  t.equal(((await once(events, 'exit')) as [number | null])[0], 1)
  t.match(said, /--kv-events must be on or off, got 'maybe'/)
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
