import { mkdtempSync, rmSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { Writable } from 'node:stream'
import type { FastifyInstance } from 'fastify'
import pino from 'pino'
import { request, type Dispatcher } from 'undici'
import { spawnService, type SpawnedService } from '../../common/spawn.js'
import { buildApp, type RouterDeps } from '../../router/src/app.js'
import { loadConfig } from '../../router/src/config.js'
import type { InstanceConfig, RouterConfig } from '../../schemas/router-config.js'

/** Minimal surface of a tap test used by the helpers (teardown registration). */
export interface Teardown {
  teardown(fn: () => unknown): void
}

/** Starts a real simulator process; stopped when the test ends. */
export async function startSim(t: Teardown, args: string[] = []): Promise<SpawnedService> {
  const sim = await spawnService({ args: ['sim', '--port', '0', '--log-level', 'warn', ...args] })
  t.teardown(() => sim.stop())
  return sim
}

type Section<V> = V extends readonly unknown[] ? V : V extends object ? Partial<V> : V

/** Config overrides for a test router: a section (`limits`, `events`…) given in part keeps its other defaults. */
export type RouterOverrides = { [K in keyof Omit<RouterConfig, 'instances'>]?: Section<RouterConfig[K]> }

/** Builds an in-process router (real code, real sockets) in front of the given instances. */
export async function startRouter(
  t: Teardown,
  instances: InstanceConfig[],
  overrides: RouterOverrides & { probe?: boolean; listenPort?: number } = {},
): Promise<{ app: FastifyInstance; url: string; logs: Record<string, unknown>[] }> {
  // listenPort: a port chosen beforehand, for processes started before the router that must know its URL.
  const { probe, listenPort, ...rest } = overrides
  const base = loadConfig({ overrides: { port: 0, logLevel: 'warn' } }) as unknown as Record<string, unknown>
  const merged: Record<string, unknown> = { ...base, instances }
  for (const [k, v] of Object.entries(rest)) {
    const b = base[k]
    const plain = (x: unknown): x is Record<string, unknown> => typeof x === 'object' && x !== null && !Array.isArray(x)
    merged[k] = plain(v) && plain(b) ? { ...b, ...v } : v
  }
  const config = merged as unknown as RouterConfig
  const logs: Record<string, unknown>[] = []
  const sink = new Writable({
    write(chunk: Buffer, _enc, cb) {
      for (const line of chunk.toString('utf8').split('\n')) if (line) logs.push(JSON.parse(line) as Record<string, unknown>)
      cb()
    },
  })
  const deps: RouterDeps = { config, logger: pino({ level: 'info' }, sink), ...(probe === false ? { probe: false } : {}) }
  const app = await buildApp(deps)
  const url = await app.listen({ host: '127.0.0.1', port: listenPort ?? 0 })
  t.teardown(() => app.close())
  return { app, url, logs }
}

/** A router process (`handoff router --config`) that a test can crash and start again. */
export interface RouterProcess {
  readonly url: string
  /** The process running now (another one after a restart). */
  readonly service: SpawnedService
  /** SIGKILL, as a crash or an OOM kill would end it; resolves once it exited. */
  crash(): Promise<void>
  /** A new process with the same config: at the same URL when the config names its port. */
  restart(): Promise<void>
}

/** Starts a router process from `config` (a config file's content); stopped when the test ends. */
export async function spawnRouter(t: Teardown, config: Record<string, unknown>, env?: NodeJS.ProcessEnv): Promise<RouterProcess> {
  const dir = mkdtempSync(join(tmpdir(), 'handoff-router-'))
  const file = join(dir, 'router.json')
  writeFileSync(file, JSON.stringify({ port: 0, logLevel: 'warn', ...config }))
  const start = () => spawnService({ args: ['router', '--config', file], ...(env ? { env } : {}) })
  let service = await start()
  t.teardown(async () => {
    await service.stop()
    rmSync(dir, { recursive: true, force: true })
  })
  const crash = async (): Promise<void> => {
    const { child } = service
    if (child.exitCode !== null || child.signalCode !== null) return
    const exited = new Promise((resolve) => child.once('exit', resolve))
    child.kill('SIGKILL')
    await exited
  }
  return {
    get url() {
      return service.url
    },
    get service() {
      return service
    },
    crash,
    async restart() {
      await crash()
      service = await start()
    },
  }
}

export interface Posted {
  status: number
  headers: Record<string, string | string[] | undefined>
  text: string
  json<T = Record<string, unknown>>(): T
}

async function send(url: string, opts: Omit<Dispatcher.RequestOptions, 'origin' | 'path'>, timeoutMs = 30_000): Promise<Posted> {
  const res = await request(url, { ...opts, headersTimeout: timeoutMs, bodyTimeout: timeoutMs })
  const text = await res.body.text()
  return { status: res.statusCode, headers: res.headers, text, json: <T>() => JSON.parse(text) as T }
}

/** POSTs a body (an object is sent as JSON, a string as it is); head and body each within `timeoutMs`. */
export function post(url: string, body: unknown, headers: Record<string, string> = {}, timeoutMs?: number): Promise<Posted> {
  return send(
    url,
    {
      method: 'POST',
      body: typeof body === 'string' ? body : JSON.stringify(body),
      headers: { 'content-type': 'application/json', ...headers },
    },
    timeoutMs,
  )
}

export function get(url: string, headers: Record<string, string> = {}): Promise<Posted> {
  return send(url, { method: 'GET', headers })
}

/** Parses an SSE body into its `data:` payloads (JSON objects, plus the literal [DONE]). */
export function sseEvents(text: string): (Record<string, unknown> | '[DONE]')[] {
  const out: (Record<string, unknown> | '[DONE]')[] = []
  for (const block of text.split('\n\n')) {
    const line = block.split('\n').find((l) => l.startsWith('data: '))
    if (!line) continue
    const data = line.slice(6)
    out.push(data === '[DONE]' ? '[DONE]' : (JSON.parse(data) as Record<string, unknown>))
  }
  return out
}

/** Concatenated text of a streamed completion or chat completion. */
export function streamedText(text: string): string {
  let out = ''
  for (const ev of sseEvents(text)) {
    if (ev === '[DONE]') continue
    for (const c of (ev.choices as { text?: string; delta?: { content?: string } }[] | undefined) ?? []) {
      out += c.text ?? c.delta?.content ?? ''
    }
  }
  return out
}

/** What a simulator received (its /sim/requests log). */
export interface SimRequestRecord {
  path: string
  headers: Record<string, string>
  body: Record<string, unknown>
}

export async function simRequests(sim: SpawnedService): Promise<SimRequestRecord[]> {
  return (await get(`${sim.url}/sim/requests`)).json<{ requests: SimRequestRecord[] }>().requests
}

/** Polls `check` every 25 ms until it returns true or `timeoutMs` passes. */
export async function waitFor(check: () => Promise<boolean> | boolean, timeoutMs = 5000): Promise<boolean> {
  const deadline = Date.now() + timeoutMs
  while (Date.now() < deadline) {
    if (await check()) return true
    await new Promise((r) => setTimeout(r, 25))
  }
  return false
}
