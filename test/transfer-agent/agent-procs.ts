// Real `handoff agent` processes for the transfer-agent tests, with the test process acting as
// their engines: it owns the shared-memory KV regions, attaches them, leases and pulls over
// HTTP and reads the bytes itself. Every resource is released in t.teardown.
import { spawnService, type SpawnedService } from '../../common/spawn.js'
import { mapSharedMemory, type SharedMemory } from '../../native/index.js'
import type { AgentAttached, AgentEvent } from '../../schemas/agent-api.js'
import { needNixl, probeNixl, type NixlProbe } from '../native/helpers.js'


interface TapLike {
  teardown(fn: () => unknown): void
  fail(message: string): void
  comment(message: string): void
}

/** tap's `skip` for tests that need NIXL: a reason locally, false under CI (which fails). */
export async function skipWithoutNixl(t: Pick<TapLike, 'fail' | 'comment'>): Promise<string | false> {
  const probe: NixlProbe = await probeNixl()
  return needNixl(t, probe)
}

export interface Reply<T = Record<string, unknown>> {
  status: number
  body: T
}

export interface Agent {
  readonly svc: SpawnedService
  readonly url: string
  readonly port: number
  call<T = Record<string, unknown>>(method: string, path: string, body?: unknown, headers?: Record<string, string>): Promise<Reply<T>>
  /** Events after `after`, waiting up to `waitMs` for one. */
  events(after?: number, waitMs?: number): Promise<{ agentId: string; events: AgentEvent[]; last: number }>
  /** A metric's value (summed over label sets matching `labels`), 0 when absent. */
  metric(name: string, labels?: Record<string, string>): Promise<number>
  stop(): Promise<unknown>
}

const CALL_TIMEOUT_MS = 20_000

export async function startAgent(t: TapLike, args: string[] = [], env: NodeJS.ProcessEnv = {}): Promise<Agent> {
  const svc = await spawnService({
    args: ['agent', '--log-level', 'warn', ...(args.includes('--port') ? [] : ['--port', '0']), ...args],
    env: { ...process.env, ...env },
    readyTimeoutMs: 30_000,
  })
  t.teardown(async () => {
    // A SIGSTOPped child ignores SIGTERM until continued.
    if (svc.child.exitCode === null && svc.child.signalCode === null) svc.child.kill('SIGCONT')
    await svc.stop(3_000)
  })
  return agentAt(svc)
}

function agentAt(svc: SpawnedService): Agent {
  const url = svc.url.replace(/\/$/, '')
  const call = async <T,>(method: string, path: string, body?: unknown, headers: Record<string, string> = {}): Promise<Reply<T>> => {
    const r = await fetch(url + path, {
      method,
      headers: { ...(body === undefined ? {} : { 'content-type': 'application/json' }), ...headers },
      body: body === undefined ? undefined : JSON.stringify(body),
      signal: AbortSignal.timeout(CALL_TIMEOUT_MS),
    })
    const text = await r.text()
    let parsed: unknown = text
    try {
      parsed = JSON.parse(text)
    } catch {
      // Not JSON (metrics): keep the text.
    }
    return { status: r.status, body: parsed as T }
  }
  return {
    svc,
    url,
    port: Number(new URL(url).port),
    call,
    async events(after = 0, waitMs = 0) {
      const r = await call<{ agentId: string; events: AgentEvent[]; last: number }>('GET', `/v1/engine/events?after=${after}&waitMs=${waitMs}`)
      if (r.status !== 200) throw new Error(`events: ${r.status} ${JSON.stringify(r.body)}`)
      return r.body
    },
    async metric(name, labels = {}) {
      const r = await call<string>('GET', '/metrics')
      return metricValue(String(r.body), name, labels)
    },
    stop: () => svc.stop(3_000),
  }
}

/** Sums the samples of `name` whose labels include `labels` in Prometheus text. */
export function metricValue(text: string, name: string, labels: Record<string, string> = {}): number {
  let sum = 0
  for (const line of text.split('\n')) {
    const m = /^([a-zA-Z_:][\w:]*)(?:\{([^}]*)\})? (\S+)$/.exec(line)
    if (!m || m[1] !== name) continue
    const have = Object.fromEntries([...(m[2] ?? '').matchAll(/(\w+)="([^"]*)"/g)].map((x) => [x[1], x[2]]))
    if (Object.entries(labels).every(([k, v]) => have[k] === v)) sum += Number(m[3])
  }
  return sum
}

export interface Layout {
  blockSize: number
  bytesPerToken: number
  numBlocks: number
}

export interface Region {
  readonly name: string
  readonly shm: SharedMemory
  readonly bytes: Uint8Array
  readonly blockBytes: number
  block(i: number): Uint8Array
}

/**
 * A shared-memory KV region unique to this process and test, unlinked in teardown. Agents map
 * only names under their prefix (default /handoff-).
 */
export function region(t: TapLike, tag: string, layout: Layout, prefix = '/handoff-xfa-test-'): Region {
  const name = `${prefix}${process.pid}-${tag}`
  const blockBytes = layout.blockSize * layout.bytesPerToken
  const shm = mapSharedMemory(name, layout.numBlocks * blockBytes, { create: true })
  t.teardown(() => {
    try {
      shm.unlink()
    } catch {
      // Already gone.
    }
  })
  const bytes = new Uint8Array(shm.buffer)
  return { name, shm, bytes, blockBytes, block: (i) => bytes.subarray(i * blockBytes, (i + 1) * blockBytes) }
}

export async function attach(agent: Agent, engineId: string, role: 'prefill' | 'decode' | 'both', r: Region, layout: Layout): Promise<AgentAttached> {
  const res = await agent.call<AgentAttached>('POST', '/v1/engine/attach', { engineId, role, shmName: r.name, ...layout })
  if (res.status !== 200) throw new Error(`attach ${engineId}: ${res.status} ${JSON.stringify(res.body)}`)
  return res.body
}

/** Polls `agent`'s events until one matches or `timeoutMs` passes; returns it or undefined. */
export async function waitEvent(agent: Agent, match: (e: AgentEvent) => boolean, timeoutMs: number): Promise<AgentEvent | undefined> {
  const deadline = Date.now() + timeoutMs
  for (;;) {
    const left = deadline - Date.now()
    // after=0 drops nothing that was not already acknowledged: every test reads the whole log.
    const { events } = await agent.events(0, Math.max(0, Math.min(left, 1_000)))
    const hit = events.find(match)
    if (hit || Date.now() >= deadline) return hit
    await new Promise((r) => setTimeout(r, 20))
  }
}

/** Fills block `i` of `r` with a byte pattern derived from `seed` (never all one value). */
export function fillBlock(r: Region, i: number, seed: number): void {
  const b = r.block(i)
  for (let k = 0; k < b.length; k++) b[k] = (seed * 31 + k * 7 + i) & 0xff
}

export function sameBytes(a: Uint8Array, b: Uint8Array): boolean {
  return Buffer.from(a.buffer, a.byteOffset, a.byteLength).equals(Buffer.from(b.buffer, b.byteOffset, b.byteLength))
}
