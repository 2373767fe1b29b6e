import { connect } from 'node:net'
import Fastify, { type FastifyInstance } from 'fastify'
import pino from 'pino'
import { loadConfig } from '../../router/src/config.js'
import type { RouterConfig } from '../../schemas/router-config.js'

/*
 * Route-table auth tests (issue 18 item 1): collect every route an app registers, then try
 * each one without its credential under request targets a URL-prefix check would miss. The
 * requests go over a raw socket so no client normalises the target on the way.
 */

export interface RouteEntry {
  method: string
  url: string
}

/**
 * A stand-in for the `fastify` module (for `t.mockImport`): every instance it builds gets an
 * onRoute hook before its first route, so routes added at the root, in plugins or in nested
 * plugins are all seen, whichever way they were added.
 */
export function routeRecorder(): { routes: RouteEntry[]; module: { default: typeof Fastify } } {
  const routes: RouteEntry[] = []
  const factory = ((opts?: Parameters<typeof Fastify>[0]) => {
    const app = Fastify(opts) as FastifyInstance
    app.addHook('onRoute', (r) => {
      for (const method of [r.method].flat()) routes.push({ method: String(method), url: r.url })
    })
    return app
  }) as unknown as typeof Fastify
  return { routes, module: { default: factory } }
}

interface MockImporter {
  mockImport<T>(module: string, mocks: Record<string, unknown>): Promise<T>
}

/**
 * A router built with the route recorder (not listening; no probes): one decoder at an
 * address nothing answers, and `config` over the defaults.
 */
export async function recordedRouter(t: MockImporter, config: Partial<RouterConfig>): Promise<{ app: FastifyInstance; routes: RouteEntry[] }> {
  const recorder = routeRecorder()
  const { buildApp } = await t.mockImport<typeof import('../../router/src/app.js')>(new URL('../../router/src/app.ts', import.meta.url).href, { fastify: recorder.module })
  const full = {
    ...loadConfig({ overrides: { port: 0, logLevel: 'warn' } }),
    instances: [{ id: 'd0', role: 'decode', url: 'http://127.0.0.1:9' }],
    ...config,
  } as RouterConfig
  const app = await buildApp({ config: full, logger: pino({ level: 'silent' }), probe: false })
  return { app, routes: recorder.routes }
}

/** A concrete path for a route: every parameter and wildcard filled in. */
export function concretePath(url: string): string {
  return url.replace(/:[A-Za-z0-9_]+/g, 'x').replace(/\*/g, 'x')
}

/**
 * Request targets that name the route (or nearly) in forms a prefix test on `request.url`
 * gets wrong: fastify's router decodes percent-escapes and reads absolute-form targets, so
 * some of these reach the handler. `origin` is `http://host:port`.
 */
export function targetVariants(path: string, origin: string): { label: string; target: string }[] {
  const segments = path.split('/').slice(1)
  const first = segments[0] ?? ''
  const rest = segments.slice(1).join('/')
  const encoded = [...first].map((c) => `%${c.charCodeAt(0).toString(16).padStart(2, '0')}`).join('')
  const swapCase = (s: string): string => [...s].map((c) => (c === c.toUpperCase() ? c.toLowerCase() : c.toUpperCase())).join('')
  const out = [
    { label: 'plain', target: path },
    { label: 'query string', target: `${path}?after=0&x=1` },
    { label: 'trailing slash', target: `${path}/` },
    { label: 'double leading slash', target: `/${path}` },
    { label: 'upper case', target: path.toUpperCase() },
    { label: 'first segment case swapped', target: `/${swapCase(first)}${rest ? `/${rest}` : ''}` },
    { label: 'first segment percent-encoded', target: `/${encoded}${rest ? `/${rest}` : ''}` },
    { label: 'every letter percent-encoded', target: path.replace(/[A-Za-z]/g, (c) => `%${c.charCodeAt(0).toString(16)}`) },
    { label: 'dot segment', target: `/.${path}` },
    { label: 'parent segment', target: `/zz/..${path}` },
    { label: 'semicolon', target: `${path};x=1` },
    { label: 'absolute-form', target: `${origin}${path}` },
    { label: 'absolute-form, other host', target: `http://example.invalid${path}` },
    { label: 'absolute-form, percent-encoded', target: `${origin}/${encoded}${rest ? `/${rest}` : ''}` },
  ]
  if (rest) {
    out.push({ label: 'slash percent-encoded', target: `/${first}%2F${rest}` })
    out.push({ label: 'slash percent-encoded (lower)', target: `/${first}%2f${rest}` })
    out.push({ label: 'inner double slash', target: `/${first}//${rest}` })
  }
  return out
}

export interface RawResponse {
  status: number
  headers: Record<string, string>
  body: string
}

/**
 * One HTTP/1.1 request written byte for byte to `port`, the target as given. A POST carries
 * `{}` as JSON; the answer is read until the server closes (Connection: close) or `timeoutMs`.
 */
export function rawRequest(
  port: number,
  method: string,
  target: string,
  headers: Record<string, string> = {},
  timeoutMs = 3000,
): Promise<RawResponse> {
  return new Promise((resolve, reject) => {
    const body = method === 'POST' || method === 'PUT' || method === 'PATCH' ? '{}' : ''
    const lines = [`${method} ${target} HTTP/1.1`, `host: 127.0.0.1:${port}`, 'connection: close']
    if (body) lines.push('content-type: application/json', `content-length: ${Buffer.byteLength(body)}`)
    for (const [k, v] of Object.entries(headers)) lines.push(`${k}: ${v}`)
    const socket = connect(port, '127.0.0.1')
    const chunks: Buffer[] = []
    const timer = setTimeout(() => socket.destroy(), timeoutMs)
    socket.on('data', (c: Buffer) => chunks.push(c))
    socket.on('error', (err) => {
      clearTimeout(timer)
      reject(err)
    })
    socket.on('close', () => {
      clearTimeout(timer)
      const text = Buffer.concat(chunks).toString('latin1')
      const split = text.indexOf('\r\n\r\n')
      const head = split < 0 ? text : text.slice(0, split)
      const [statusLine = '', ...headerLines] = head.split('\r\n')
      const status = Number(/^HTTP\/1\.[01] (\d{3})/.exec(statusLine)?.[1] ?? 0)
      const parsed: Record<string, string> = {}
      for (const l of headerLines) {
        const i = l.indexOf(':')
        if (i > 0) parsed[l.slice(0, i).trim().toLowerCase()] = l.slice(i + 1).trim()
      }
      let rest = split < 0 ? '' : text.slice(split + 4)
      if (parsed['transfer-encoding'] === 'chunked') rest = dechunk(rest)
      resolve({ status, headers: parsed, body: Buffer.from(rest, 'latin1').toString('utf8') })
    })
    socket.write(`${lines.join('\r\n')}\r\n\r\n${body}`)
  })
}

function dechunk(s: string): string {
  let out = ''
  let i = 0
  while (i < s.length) {
    const eol = s.indexOf('\r\n', i)
    if (eol < 0) break
    const size = parseInt(s.slice(i, eol), 16)
    if (!(size > 0)) break
    out += s.slice(eol + 2, eol + 2 + size)
    i = eol + 2 + size + 2
  }
  return out
}

/** The `error.code` of an `{error: {code}}` body, or undefined. */
export function errorCode(body: string): string | undefined {
  try {
    return (JSON.parse(body) as { error?: { code?: string } }).error?.code
  } catch {
    return undefined
  }
}
