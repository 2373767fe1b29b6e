import { createServer, type Server } from 'node:http'
import type { AddressInfo, Socket } from 'node:net'
import type { FastifyInstance, FastifyPluginAsync, FastifyRequest } from 'fastify'
import { bearerChecker } from '../../common/bearer.js'
import type { RouterConfig } from '../../schemas/router-config.js'
import { RTR_ERR_ADMIN_DISABLED, RTR_ERR_ADMIN_UNAUTHORIZED, RTR_ERR_ROUTE_NOT_FOUND, RTR_ERR_UNAUTHORIZED } from './errors.js'
import { hostPort } from '../../common/host-port.js'

/*
 * The router's HTTP surface as planes (docs/security.md "Planes and their credentials"): data
 * (completions, models), operations (/admin, /fault_tolerance, /topology, /leases), agents
 * (/v1/agents…) and probes (/health, /ready, /metrics). Each plane is an encapsulated fastify
 * scope whose own onRequest hooks check, in order, the listener the request came in on and
 * the plane's credential, after routing and so for exactly the plane's routes. With
 * `adminPort` / `agentPort` the operations / agent plane answers on a listener of its own and
 * its routes do not exist anywhere else; probes answer on every listener.
 */

export type Listener = 'main' | 'admin' | 'agents'

const LISTENER = Symbol('handoff.listener')
type Tagged = Socket & { [LISTENER]?: Listener }

export function listenerOf(req: FastifyRequest): Listener {
  return (req.raw.socket as Tagged)[LISTENER] ?? 'main'
}

/** Where each plane answers under `config`. */
export function planeListeners(config: Pick<RouterConfig, 'adminPort' | 'agentPort'>): { data: Listener; operations: Listener; agents: Listener } {
  return { data: 'main', operations: config.adminPort !== undefined ? 'admin' : 'main', agents: config.agentPort !== undefined ? 'agents' : 'main' }
}

/** The first hook of a plane's scope: on another listener its routes are not there. */
export function onlyOn(scope: FastifyInstance, listener: Listener): void {
  scope.addHook('onRequest', async (req) => {
    if (listenerOf(req) !== listener) throw new RTR_ERR_ROUTE_NOT_FOUND(`${req.method} ${req.url.split('?')[0]}`)
  })
}

/** The data plane: API keys, when set, on every route. */
export function dataPlane<O extends object>(config: Pick<RouterConfig, 'apiKeys' | 'adminPort' | 'agentPort'>, routes: FastifyPluginAsync<O>, opts: O): FastifyPluginAsync {
  return async (scope) => {
    onlyOn(scope, planeListeners(config).data)
    const check = bearerChecker(config.apiKeys)
    if (check) {
      scope.addHook('onRequest', async (req) => {
        if (!check(req)) throw new RTR_ERR_UNAUTHORIZED()
      })
    }
    await scope.register(routes, opts)
  }
}

/** Marks the one operations route a drain token may call (engines' preStop drain). */
export const DRAIN_ROUTE = { plane: 'drain' } as const

/**
 * The operations plane: the admin token, always (without one the endpoints are off); a drain
 * token opens only the routes marked DRAIN_ROUTE in their `config`. `after` runs once the
 * caller is known (the store-writable check).
 */
export function operationsPlane<O extends object>(
  config: Pick<RouterConfig, 'adminToken' | 'drainTokens' | 'adminPort' | 'agentPort'>,
  routes: FastifyPluginAsync<O>,
  opts: O,
  after: (req: FastifyRequest) => Promise<void>,
): FastifyPluginAsync {
  return async (scope) => {
    onlyOn(scope, planeListeners(config).operations)
    const admin = bearerChecker(config.adminToken ? [config.adminToken] : [])
    const drain = bearerChecker(config.drainTokens)
    scope.addHook('onRequest', async (req) => {
      if (!admin) throw new RTR_ERR_ADMIN_DISABLED()
      const drainRoute = (req.routeOptions.config as { plane?: string } | undefined)?.plane === DRAIN_ROUTE.plane
      if (!admin(req) && !(drainRoute && drain?.(req))) throw new RTR_ERR_ADMIN_UNAUTHORIZED()
      await after(req)
    })
    await scope.register(routes, opts)
  }
}

/** The agent plane: its routes check their credential themselves (routes/agent-stream.ts). */
export function agentPlane<O extends object>(config: Pick<RouterConfig, 'adminPort' | 'agentPort'>, routes: FastifyPluginAsync<O>, opts: O): FastifyPluginAsync {
  return async (scope) => {
    onlyOn(scope, planeListeners(config).agents)
    await scope.register(routes, opts)
  }
}

/**
 * Starts the listeners of the planes that have a port of their own (after `app.listen`): each
 * a node server handing requests to the same fastify instance, its sockets tagged with the
 * listener. Closed with the app. Answers each listener's URL.
 */
export async function listenPlanes(app: FastifyInstance, config: Pick<RouterConfig, 'host' | 'adminPort' | 'agentPort'>): Promise<{ admin?: string; agents?: string }> {
  const out: { admin?: string; agents?: string } = {}
  for (const [listener, port] of [
    ['admin', config.adminPort],
    ['agents', config.agentPort],
  ] as const) {
    if (port === undefined) continue
    const server = createServer((req, res) => app.routing(req, res))
    server.on('connection', (socket: Tagged) => {
      socket[LISTENER] = listener
    })
    // The main server's timeouts (fastify set them), so every listener behaves alike.
    server.keepAliveTimeout = app.server.keepAliveTimeout
    server.requestTimeout = app.server.requestTimeout
    server.headersTimeout = app.server.headersTimeout
    await new Promise<void>((resolve, reject) => {
      server.once('error', reject)
      server.listen(port, config.host, () => {
        server.off('error', reject)
        resolve()
      })
    })
    app.planeServers.push(server)
    const { address, port: bound } = server.address() as AddressInfo
    out[listener] = `http://${hostPort(address, bound)}`
  }
  return out
}

declare module 'fastify' {
  interface FastifyInstance {
    /** Listeners of planes on ports of their own (listenPlanes), closed with the app. */
    planeServers: Server[]
    listenPlanes: () => Promise<{ admin?: string; agents?: string }>
  }
}
