import { setFlagsFromString } from 'node:v8'
import { runInNewContext } from 'node:vm'
import { parseArgs } from 'node:util'
import { request } from 'undici'
import { ManualClock } from '../common/clock.js'
import { seededRandom } from '../common/random.js'
import { buildApp } from '../router/src/app.js'
import { MemoryLeaseLedger } from '../router/src/leases/memory-ledger.js'
import { loadConfig } from '../router/src/config.js'
import { TopologyRegistry } from '../router/src/topology/registry.js'
import { selectRoute, type Selection } from '../router/src/topology/selection.js'
import type { InstanceConfig, RouterConfig } from '../schemas/router-config.js'

/*
 * `handoff bench events`: issue #9's control-plane figures.
 * - Fan-out: a real router (in this process, real sockets) with N agents' event streams open
 *   (light SSE clients here, not agent processes); each round registers a throwaway engine and
 *   declares it gone with POST /fault_tolerance/event; the time from sending that call to each
 *   stream receiving the event is one sample.
 * - Selection: selectRoute over a 1,000-instance snapshot (the pure function every request runs).
 * - Ledger memory: the heap that 100,000 unread leases take in the in-memory ledger.
 */

const ADMIN = 'bench-admin-token'

interface Stream {
  received: Map<number, number>
  close(): void
}

async function openStream(url: string, agentId: string): Promise<Stream> {
  const received = new Map<number, number>()
  const ac = new AbortController()
  const res = await request(`${url}/v1/agents/${agentId}/events?after=0`, { signal: ac.signal, bodyTimeout: 0 })
  let buf = ''
  res.body.on('data', (chunk: Buffer) => {
    const now = performance.now()
    buf += chunk.toString('utf8')
    let i: number
    while ((i = buf.indexOf('\n\n')) >= 0) {
      const frame = buf.slice(0, i)
      buf = buf.slice(i + 2)
      const m = /^id: (\d+)$/m.exec(frame)
      if (m) received.set(Number(m[1]), now)
    }
  })
  res.body.on('error', () => undefined)
  return { received, close: () => ac.abort() }
}

const post = async (url: string, body: unknown, headers: Record<string, string> = {}): Promise<number> => {
  const res = await request(url, { method: 'POST', headers: { 'content-type': 'application/json', ...headers }, body: JSON.stringify(body) })
  await res.body.dump()
  return res.statusCode
}

function quantile(sorted: number[], q: number): number {
  return sorted[Math.min(sorted.length - 1, Math.floor(q * sorted.length))] ?? NaN
}

const fmt = (ms: number): string => (ms >= 10 ? ms.toFixed(1) : ms.toFixed(2))

async function fanOut(agents: number, rounds: number): Promise<string> {
  const config = { ...loadConfig({ overrides: { port: 0, logLevel: 'silent' } }), instances: [], adminToken: ADMIN } as RouterConfig
  const app = await buildApp({ config, probe: false })
  const url = await app.listen({ host: '127.0.0.1', port: 0 })
  const streams: Stream[] = []
  try {
    for (let i = 0; i < agents; i++) {
      await post(`${url}/v1/agents`, { agentId: `a${i}`, engineId: `e${i}`, role: 'decode', agentUrl: `http://127.0.0.1:${20000 + i}` })
      streams.push(await openStream(url, `a${i}`))
    }
    const samples: number[] = []
    const perEvent: number[] = []
    for (let r = 0; r < rounds; r++) {
      // A throwaway engine to declare gone (unknown engines are a no-op by design).
      await post(`${url}/v1/agents`, { agentId: `gone${r}`, engineId: `gone-${r}`, role: 'prefill', agentUrl: `http://127.0.0.1:${40000 + r}` })
      const sent = performance.now()
      const status = await post(`${url}/fault_tolerance/event`, { event_type: 'peer_gone', nodes: { engine_ids: [`gone-${r}`] } }, { authorization: `Bearer ${ADMIN}` })
      if (status !== 202) throw new Error(`fault_tolerance/event answered ${status}`)
      const seq = await app.events.store.last()
      const deadline = performance.now() + 5000
      while (streams.some((s) => !s.received.has(seq)) && performance.now() < deadline) await new Promise((resolve) => setImmediate(resolve))
      let last = 0
      for (const s of streams) {
        const at = s.received.get(seq)
        if (at === undefined) throw new Error(`event ${seq} not received by every stream within 5 s`)
        samples.push(at - sent)
        last = Math.max(last, at - sent)
      }
      perEvent.push(last)
    }
    samples.sort((a, b) => a - b)
    perEvent.sort((a, b) => a - b)
    return `| ${agents} | ${rounds} | ${fmt(quantile(samples, 0.5))} / ${fmt(quantile(samples, 0.99))} | ${fmt(quantile(perEvent, 0.5))} / ${fmt(quantile(perEvent, 0.99))} |`
  } finally {
    for (const s of streams) s.close()
    await app.close()
  }
}

/**
 * One pick as a request makes it (issue 23 item 3): select, take the slots, give them back
 * (each of which changes the topology, as in the router), at `instances` instances, half
 * prefillers, in 10 transfer groups. The scan (`selectRoute` over a fresh snapshot, what every
 * pick did before the candidate lists) and the registry's own `select`, in the same run.
 */
function selection(instances: number, quick: boolean): string[] {
  const configs: InstanceConfig[] = []
  for (let i = 0; i < instances; i++) configs.push({ id: `i${i}`, role: i % 2 === 0 ? 'prefill' : 'decode', url: `http://10.${i >> 16}.${(i >> 8) & 255}.${i & 255}:8000`, labels: { transfer_group: `g${Math.floor(i / 2) % 10}` } })
  const rows: string[] = []
  for (const mode of ['all', 'label'] as const) {
    const pairing = { mode, label: 'transfer_group' }
    const registry = new TopologyRegistry({ clock: new ManualClock(), policy: { unhealthyThreshold: 3, baseEjectionMs: 5000, maxEjectionMs: 120000 }, instances: configs, pairing, limit: 256 })
    const random = seededRandom(1)
    const limits = {}
    const cycle = (sel: Selection | undefined): void => {
      if (sel?.mode !== 'pd') throw new Error(`bench: no P/D route (${sel?.mode})`)
      registry.acquire(sel.prefill.id)
      registry.acquire(sel.decode.id)
      registry.release(sel.prefill.id)
      registry.release(sel.decode.id)
    }
    // Warmed up (the JIT), then timed; the scan gets fewer rounds, in proportion to its cost.
    const time = (pick: () => Selection | undefined, rounds: number): number => {
      for (let i = 0; i < rounds / 4; i++) cycle(pick())
      const start = process.hrtime.bigint()
      for (let i = 0; i < rounds; i++) cycle(pick())
      return Number(process.hrtime.bigint() - start) / 1000 / rounds
    }
    const scale = quick ? 0.1 : 1
    const scan = time(() => selectRoute(registry.snapshot(), 'handoff/sim-1', pairing, random, limits), Math.ceil(scale * Math.max(200, Math.min(20_000, 4_000_000 / instances))))
    const lists = time(() => registry.select('handoff/sim-1', random, limits), Math.ceil(scale * 100_000))
    if (registry.selectionScans !== 0) throw new Error(`bench: ${registry.selectionScans} picks fell back to the scan`)
    rows.push(`| ${instances.toLocaleString('en-US')} | ${mode} | ${scan.toFixed(2)} | ${lists.toFixed(2)} | ${(scan / lists).toFixed(1)}x |`)
  }
  return rows
}

/** Heap bytes per unread lease with `count` of them held (a forced GC before each reading). */
function ledgerMemory(count: number): string {
  setFlagsFromString('--expose-gc')
  const gc = runInNewContext('gc') as () => void
  const clock = new ManualClock()
  gc()
  const before = process.memoryUsage().heapUsed
  const ledger = new MemoryLeaseLedger({ clock, leaseSeconds: 30, marginMs: 1000, retentionMs: 60_000, maxEntries: count })
  for (let i = 0; i < count; i++) {
    // Ids shaped like the real ones: hnd-<24 hex>, vLLM's cmpl-<id>-<8 hex>, a uuid client id.
    const id = `hnd-${i.toString(16).padStart(24, '0')}`
    ledger.issue({
      requestId: id,
      clientRequestId: `${i.toString(16).padStart(8, '0')}-4f6a-4c2e-9b1d-5a3e2f1c0d9b`,
      prefill: `prefill-${i % 16}`,
      decode: `decode-${i % 16}`,
      engineId: `sim-${(i % 16).toString(16).padStart(16, '0')}`,
      remoteRequestId: `cmpl-${id}-${(i * 2654435761 >>> 0).toString(16).padStart(8, '0')}`,
      issuedAt: clock.now(),
    })
  }
  gc()
  const after = process.memoryUsage().heapUsed
  if (ledger.size !== count) throw new Error(`ledger holds ${ledger.size} of ${count}`)
  const mib = (after - before) / 2 ** 20
  return `| ${count.toLocaleString('en-US')} | ${mib.toFixed(1)} | ${Math.round((after - before) / count)} |`
}

export async function runEventsBench(argv: string[]): Promise<void> {
  const { values } = parseArgs({ args: argv, options: { quick: { type: 'boolean' }, help: { type: 'boolean' } } })
  if (values.help) {
    process.stdout.write('usage: handoff bench events [--quick]\n\nEvent fan-out latency to 1, 10 and 100 agent streams, and pair selection time at 10, 1,000 and 10,000 instances.\n')
    return
  }
  const rounds = values.quick ? 20 : 200
  const lines = ['| agents | events | send → each stream received, p50 / p99 ms | send → last stream received, p50 / p99 ms |', '| ---: | ---: | ---: | ---: |']
  for (const n of [1, 10, 100]) {
    process.stderr.write(`fan-out to ${n} agent stream(s)…\n`)
    lines.push(await fanOut(n, rounds))
  }
  lines.push('', '| instances | pairing | µs per pick, scan (snapshot + selectRoute) | µs per pick, candidate lists | faster |', '| ---: | --- | ---: | ---: | ---: |')
  for (const n of [10, 1000, 10_000]) {
    process.stderr.write(`selection at ${n} instances…\n`)
    lines.push(...selection(n, values.quick === true))
  }
  lines.push('', '| unread leases | heap MiB | bytes per lease |', '| ---: | ---: | ---: |')
  lines.push(ledgerMemory(values.quick ? 10_000 : 100_000))
  process.stdout.write(lines.join('\n') + '\n')
}
