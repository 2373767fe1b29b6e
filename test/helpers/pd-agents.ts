import './ucx-hooks.js'
import { request } from 'undici'
import { freePort } from '../../common/ports.js'
import { spawnService, type SpawnedService } from '../../common/spawn.js'
import { oracleForBody } from '../../sim/src/oracle.js'
import { spawnRouter, type Teardown } from './cluster.js'

/*
 * Real P/D clusters in agent mode for scenario tests: every engine is a simulator process
 * with its own transfer agent process, and the router is a process too. Engines can be
 * stopped (SIGSTOP), killed and restarted at the same ports, which is what the scenarios do.
 */


export interface EngineOptions {
  role: 'prefill' | 'decode' | 'both'
  leaseSeconds: number
  /** Extra `handoff sim` flags (e.g. --kv-load-failure-policy recompute). */
  simArgs?: string[]
  /** Extra `handoff agent` flags. */
  agentArgs?: string[]
  agentEnv?: NodeJS.ProcessEnv
}

/** One engine: a simulator and its agent, restartable at the same ports. */
export class Engine {
  sim!: SpawnedService
  agent!: SpawnedService
  readonly opts: EngineOptions
  #simPort = 0
  #agentPort = 0

  constructor(opts: EngineOptions) {
    this.opts = opts
  }

  get simPort(): number {
    return this.#simPort
  }

  async startAgent(): Promise<void> {
    const o = this.opts
    this.agent = await spawnService({
      args: ['agent', '--port', String(this.#agentPort), '--lease-seconds', String(o.leaseSeconds), '--log-level', 'warn', ...(o.agentArgs ?? [])],
      env: { ...process.env, ...(o.agentEnv ?? {}) },
    })
    this.#agentPort = Number(new URL(this.agent.url).port)
  }

  async startSim(extra: string[] = []): Promise<void> {
    const o = this.opts
    this.sim = await spawnService({
      args: [
        'sim',
        '--role',
        o.role,
        '--port',
        String(this.#simPort),
        '--kv',
        'agent',
        '--agent-url',
        this.agent.url,
        '--lease-seconds',
        String(o.leaseSeconds),
        '--log-level',
        'warn',
        ...(o.simArgs ?? []),
        ...extra,
      ],
    })
    this.#simPort = Number(new URL(this.sim.url).port)
  }

  async start(): Promise<this> {
    // Ports below the ephemeral range (freePort): a process restarted at its port must find
    // it free, and while it is down its peers redial it; a port the kernel may also hand out
    // as a source port can be taken by such a dial connecting to itself.
    this.#agentPort ||= await freePort()
    this.#simPort ||= await freePort()
    await this.startAgent()
    await this.startSim()
    return this
  }

  /** SIGKILL both processes (a crash of the whole engine pod). */
  async kill(): Promise<void> {
    await Promise.all([killHard(this.sim), killHard(this.agent)])
  }

  async stop(): Promise<void> {
    await this.sim?.stop().catch(() => undefined)
    await this.agent?.stop().catch(() => undefined)
  }
}

async function killHard(s: SpawnedService | undefined): Promise<void> {
  if (!s || s.child.exitCode !== null || s.child.signalCode !== null) return
  const exited = new Promise((resolve) => s.child.once('exit', resolve))
  s.child.kill('SIGKILL')
  await exited
}

/**
 * Simulator flags for a prefiller whose freed blocks are reused at once, so a read after its
 * lease ended lands on another request's bytes on the next prefill: stale-read scenarios
 * need that to see the hazard. With prefix caching (vLLM's default) a freed full block waits
 * behind every older free block before reuse: the same failure, only under memory pressure.
 */
export const REUSING_PREFILLER = ['--num-gpu-blocks-override', '512', '--no-enable-prefix-caching'] as const

export async function startEngine(t: Teardown, opts: EngineOptions): Promise<Engine> {
  const e = new Engine(opts)
  t.teardown(() => e.stop())
  return e.start()
}

/**
 * A decoder that reads without checking P's lease, as stock vLLM does in pull mode: its agent
 * runs with the deadline checks off (the test-only switch).
 */
export function startUncheckedDecoder(t: Teardown, leaseSeconds: number): Promise<Engine> {
  return startEngine(t, {
    role: 'decode',
    leaseSeconds,
    simArgs: ['--kv-load-failure-policy', 'fail'],
    agentArgs: ['--unsafe-skip-deadline-checks'],
    agentEnv: { HANDOFF_ALLOW_UNSAFE: '1' },
  })
}

/** A router process in front of `engines` (config file written to a temp folder). */
export async function startRouterProcess(t: Teardown, engines: Engine[], config: Record<string, unknown> = {}): Promise<SpawnedService> {
  const instances = engines.map((e, i) => ({ id: `${e.opts.role}-${i}`, role: e.opts.role, url: e.sim.url }))
  return (await spawnRouter(t, { instances, ...config })).service
}

export interface Outcome {
  i: number
  status: number
  /** The generated text of a 200, else undefined. */
  text: string | undefined
  expected: string
  /** 200 and text equal to the oracle's. */
  ok: boolean
  /** 200 with text that is NOT the oracle's: a stale or wrong read that reached a client. */
  wrong: boolean
  /** The error code of a failed answer (body error.code), or a transport error's name. */
  code: string | undefined
  /** The error message of a failed answer. */
  message: string | undefined
  ms: number
}

export function completionBody(i: number, tag: string, maxTokens = 8): Record<string, unknown> {
  // Distinct prompts of a few blocks each, so a reused block holds other bytes.
  return {
    model: 'handoff/sim-1',
    prompt: `${tag} request ${i}: the quick brown fox jumps over the lazy dog ${i * 7919} times while ${tag} counts ${i}`,
    max_tokens: maxTokens,
  }
}

/** One non-streamed completion through `url`, compared with the oracle. */
export async function complete(url: string, body: Record<string, unknown>, i: number, timeoutMs = 60_000): Promise<Outcome> {
  const expected = oracleForBody('/v1/completions', body)
  const started = performance.now()
  try {
    const res = await request(`${url}/v1/completions`, {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: JSON.stringify(body),
      headersTimeout: timeoutMs,
      bodyTimeout: timeoutMs,
    })
    const raw = await res.body.text()
    let json: { choices?: { text?: string }[]; error?: { code?: string; message?: string } } = {}
    try {
      json = JSON.parse(raw) as typeof json
    } catch {
      // Not JSON: counted by status.
    }
    const text = res.statusCode === 200 ? json.choices?.[0]?.text : undefined
    return {
      i,
      status: res.statusCode,
      text,
      expected,
      ok: res.statusCode === 200 && text === expected,
      wrong: res.statusCode === 200 && text !== expected,
      code: res.statusCode === 200 ? undefined : (json.error?.code ?? `http_${res.statusCode}`),
      message: res.statusCode === 200 ? undefined : (json.error?.message ?? raw.slice(0, 300)),
      ms: performance.now() - started,
    }
  } catch (err) {
    const e = err as Error
    return { i, status: 0, text: undefined, expected, ok: false, wrong: false, code: e.name, message: e.message, ms: performance.now() - started }
  }
}

export interface Tally {
  requests: number
  ok: number
  wrong: number
  failed: number
  codes: Record<string, number>
}

export function tally(outcomes: readonly Outcome[]): Tally {
  const codes: Record<string, number> = {}
  for (const o of outcomes) if (o.code) codes[o.code] = (codes[o.code] ?? 0) + 1
  return {
    requests: outcomes.length,
    ok: outcomes.filter((o) => o.ok).length,
    wrong: outcomes.filter((o) => o.wrong).length,
    failed: outcomes.filter((o) => o.status !== 200).length,
    codes,
  }
}

/** One metric's value from a Prometheus text endpoint (sum over series matching `labels`). */
export async function metric(url: string, name: string, labels: Record<string, string> = {}): Promise<number> {
  const res = await request(`${url}/metrics`)
  const text = await res.body.text()
  let sum = 0
  for (const line of text.split('\n')) {
    if (!line.startsWith(name)) continue
    const m = /^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)/.exec(line)
    if (!m || m[1] !== name) continue
    const lab = m[2] ?? ''
    if (!Object.entries(labels).every(([k, v]) => lab.includes(`${k}="${v}"`))) continue
    sum += Number(m[3])
  }
  return sum
}

export const sleep = (ms: number): Promise<void> => new Promise((resolve) => setTimeout(resolve, ms))

/** Polls `check` every 10 ms until it holds or `ms` pass; returns the elapsed ms, or -1 on timeout. */
export async function within(ms: number, check: () => Promise<boolean>): Promise<number> {
  const start = performance.now()
  while (performance.now() - start < ms) {
    if (await check().catch(() => false)) return performance.now() - start
    await sleep(10)
  }
  return -1
}

/**
 * A request that stays between its legs: the decoder's agent is stopped (SIGSTOP) before it
 * is sent, so its lease is held unread until `abort()` (the client leaves) and `resume()`
 * (SIGCONT; also at teardown). `pending` resolves to the error's name once aborted.
 */
export function stuckRequest(t: Teardown, routerUrl: string, decoder: Engine, body: Record<string, unknown>): { pending: Promise<string | unknown>; abort(): void; resume(): void } {
  decoder.agent.child.kill('SIGSTOP')
  let stopped = true
  const resume = (): void => {
    if (stopped) decoder.agent.child.kill('SIGCONT')
    stopped = false
  }
  t.teardown(resume)
  const ac = new AbortController()
  const pending = request(`${routerUrl}/v1/completions`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify(body), signal: ac.signal }).catch(
    (err: Error) => err.name,
  )
  return { pending, abort: () => ac.abort(), resume }
}
