import { readFileSync } from 'node:fs'
import { createAjv, describeErrors } from '../../schemas/ajv.js'
import type { RouterConfig } from '../../schemas/router-config.js'
import { RTR_ERR_CONFIG } from './errors.js'

/**
 * The only place the router reads its environment. Precedence: flags > env > file > schema
 * defaults. The result is validated against RouterConfig and deep-frozen.
 *
 * Env: HANDOFF_HOST, HANDOFF_PORT, HANDOFF_LOG_LEVEL, HANDOFF_API_KEYS (comma-separated),
 * HANDOFF_ADMIN_TOKEN, HANDOFF_DRAIN_TOKEN, HANDOFF_AGENT_TOKEN, HANDOFF_UPSTREAM_API_KEY, HANDOFF_INSTANCES (JSON array),
 * HANDOFF_STORE (`memory` or a redis:// URL), HANDOFF_LEASE_SECONDS (leases.leaseSeconds).
 */
export interface ConfigSources {
  file?: string
  env?: NodeJS.ProcessEnv
  /** What was ignored, and why (the router logs it once its logger exists). */
  onWarning?: (message: string) => void
  overrides?: Partial<Pick<RouterConfig, 'host' | 'port' | 'adminPort' | 'agentPort' | 'logLevel'>> & { store?: string; leaseSeconds?: number }
}

function readFile(file: string): Record<string, unknown> {
  let text: string
  try {
    text = readFileSync(file, 'utf8')
  } catch (err) {
    throw new RTR_ERR_CONFIG(`cannot read ${file}: ${(err as Error).message}`, { cause: err })
  }
  try {
    const parsed: unknown = JSON.parse(text)
    if (typeof parsed !== 'object' || parsed === null || Array.isArray(parsed)) throw new Error('top level must be an object')
    return parsed as Record<string, unknown>
  } catch (err) {
    throw new RTR_ERR_CONFIG(`${file} is not valid JSON: ${(err as Error).message}`, { cause: err })
  }
}

/** 127.0.0.0/8, ::1 and localhost: only this host can reach a listener there. */
function isLoopback(host: string): boolean {
  return host === 'localhost' || host === '::1' || /^127\.\d{1,3}\.\d{1,3}\.\d{1,3}$/.test(host)
}

function fromEnv(env: NodeJS.ProcessEnv, warn: (message: string) => void): Record<string, unknown> {
  const out: Record<string, unknown> = {}
  if (env.HANDOFF_HOST) out.host = env.HANDOFF_HOST
  // A Kubernetes service link: a Service named `handoff` (the chart's release name) makes the
  // kubelet inject HANDOFF_PORT=tcp://<ClusterIP>:<port> into every pod of its namespace.
  if (env.HANDOFF_PORT && /^(tcp|udp|sctp):\/\//.test(env.HANDOFF_PORT)) {
    warn(`HANDOFF_PORT=${env.HANDOFF_PORT} ignored: it is a Kubernetes service link (a Service named "handoff"), not a port; set enableServiceLinks: false on the pod`)
  } else if (env.HANDOFF_PORT) {
    const port = Number(env.HANDOFF_PORT)
    out.port = Number.isInteger(port) ? port : env.HANDOFF_PORT
  }
  if (env.HANDOFF_LOG_LEVEL) out.logLevel = env.HANDOFF_LOG_LEVEL
  if (env.HANDOFF_API_KEYS) out.apiKeys = env.HANDOFF_API_KEYS.split(',').map((k) => k.trim()).filter(Boolean)
  if (env.HANDOFF_ADMIN_TOKEN) out.adminToken = env.HANDOFF_ADMIN_TOKEN
  if (env.HANDOFF_DRAIN_TOKEN) out.drainTokens = [env.HANDOFF_DRAIN_TOKEN]
  if (env.HANDOFF_AGENT_TOKEN) out.agentToken = env.HANDOFF_AGENT_TOKEN
  if (env.HANDOFF_UPSTREAM_API_KEY) out.upstreamApiKey = env.HANDOFF_UPSTREAM_API_KEY
  if (env.HANDOFF_STORE) out.store = storeFrom(env.HANDOFF_STORE)
  if (env.HANDOFF_LEASE_SECONDS) out.leaseSeconds = Number(env.HANDOFF_LEASE_SECONDS)
  if (env.HANDOFF_INSTANCES) {
    try {
      out.instances = JSON.parse(env.HANDOFF_INSTANCES)
    } catch (err) {
      throw new RTR_ERR_CONFIG(`HANDOFF_INSTANCES is not valid JSON: ${(err as Error).message}`, { cause: err })
    }
  }
  return out
}

/** `memory`, or a redis:// (or redis+sentinel://) URL: the shorthand of env and `--store` for `store: {kind, url}`. */
function storeFrom(value: string): Record<string, unknown> {
  if (value === 'memory') return { kind: 'memory' }
  if (/^rediss?(\+sentinel)?:\/\//.test(value)) return { kind: 'redis', url: value }
  throw new RTR_ERR_CONFIG(`store must be 'memory', a redis:// URL or a redis+sentinel:// one, got '${value.includes('@') ? `${value.slice(0, value.indexOf('://') + 3)}…` : value}'`)
}

function deepFreeze<T>(value: T): T {
  if (typeof value === 'object' && value !== null) {
    for (const v of Object.values(value)) deepFreeze(v)
    Object.freeze(value)
  }
  return value
}

export function loadConfig(sources: ConfigSources = {}): RouterConfig {
  const { store, leaseSeconds, ...overrides } = sources.overrides ?? {}
  const file = sources.file ? readFile(sources.file) : {}
  const { leaseSeconds: envLease, ...env } = fromEnv(sources.env ?? {}, sources.onWarning ?? (() => {}))
  const raw: Record<string, unknown> = {
    ...file,
    ...env,
    ...Object.fromEntries(Object.entries(overrides).filter(([, v]) => v !== undefined)),
  }
  // The shorthand keeps the file's other store settings (prefix, TTLs).
  const shorthand = store !== undefined ? storeFrom(store) : (env.store as Record<string, unknown> | undefined)
  if (shorthand) raw.store = { ...((file.store as Record<string, unknown> | undefined) ?? {}), ...shorthand }
  // The engines' lease, given where the engines' is (handoff up): the file's other lease settings stay.
  const lease = leaseSeconds ?? envLease
  if (lease !== undefined) raw.leases = { ...((file.leases as Record<string, unknown> | undefined) ?? {}), leaseSeconds: lease }
  // verbose: the errors carry the schema, so describeErrors can name the nearest known key.
  const validate = createAjv({ verbose: true }).getSchema('RouterConfig')
  if (!validate) throw new RTR_ERR_CONFIG('RouterConfig schema missing')
  if (!validate(raw)) throw new RTR_ERR_CONFIG(describeErrors(validate.errors))
  const config = raw as unknown as RouterConfig
  const ids = new Set<string>()
  for (const inst of config.instances) {
    if (ids.has(inst.id)) throw new RTR_ERR_CONFIG(`duplicate instance id ${inst.id}`)
    ids.add(inst.id)
  }
  if (config.leases.marginMs >= config.leases.leaseSeconds * 1000) {
    throw new RTR_ERR_CONFIG(`leases.marginMs (${config.leases.marginMs}) must be below the lease (leases.leaseSeconds ${config.leases.leaseSeconds} s)`)
  }
  if (config.agentToken === undefined && !isLoopback(config.host)) {
    // Registration and the agents' event streams (and the events they carry) would be open to
    // anyone who reaches the router (issue 18 item 2).
    throw new RTR_ERR_CONFIG(
      `the router listens on ${config.host}, beyond loopback, without an agent token: anyone reaching it could register agents and read their event streams. Set agentToken (HANDOFF_AGENT_TOKEN, the same on every agent's --agent-token), or listen on 127.0.0.1`,
    )
  }
  // Plane ports come from the file or flags only: a Service named `<release>-admin` injects
  // HANDOFF_ADMIN_PORT=tcp://… into pods, so no plane port is read from the environment.
  for (const key of ['adminPort', 'agentPort'] as const) {
    const p = config[key]
    if (p === undefined || p === 0) continue
    const clash = p === config.port ? 'port' : key === 'agentPort' && p === config.adminPort ? 'adminPort' : undefined
    if (clash) throw new RTR_ERR_CONFIG(`${key} (${p}) must differ from ${clash}: a plane on its own port is one no other plane answers on`)
  }
  if (config.drainTokens.some((d) => d === config.adminToken || d === config.agentToken)) {
    throw new RTR_ERR_CONFIG('a drain token must differ from the admin and agent tokens: engines hold it')
  }
  if (config.store.kind === 'redis' && config.store.url === undefined) {
    throw new RTR_ERR_CONFIG('store.kind redis needs store.url (redis://host:port)')
  }
  const d = config.discovery
  if (d && !d.prefill && !d.decode && !d.both) {
    throw new RTR_ERR_CONFIG('discovery needs at least one of prefill, decode, both ({selector, port})')
  }
  return deepFreeze(config)
}
