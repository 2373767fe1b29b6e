import { randomUUID } from 'node:crypto'
import type { Server } from 'node:http'
import Fastify, { type FastifyBaseLogger, type FastifyError, type FastifyInstance } from 'fastify'
import { processSchemaController } from '../../common/schema-compilers.js'
import { systemClock, type Clock } from '../../common/clock.js'
import { limitJsonDepth } from '../../common/json-body.js'
import { loggerOptions, withRequestSerializers } from '../../common/logger.js'
import type { Logger } from 'pino'
import { systemRandom, type Random } from '../../common/random.js'
import { sharedSchemas } from '../../schemas/index.js'
import type { RouterConfig } from '../../schemas/router-config.js'
import {
  errorBody,
  isRouterError,
  RTR_ERR_BODY_TOO_LARGE,
  RTR_ERR_INTERNAL,
  RTR_ERR_INVALID_JSON,
  RTR_ERR_INVALID_REQUEST,
  RTR_ERR_ROUTE_NOT_FOUND,
  RTR_ERR_SHUTTING_DOWN,
  RTR_ERR_STORE_UNAVAILABLE,
  RTR_ERR_UNSUPPORTED_MEDIA_TYPE,
  type CodedError,
  type RouterErrorCode,
} from './errors.js'
import { RouterEvents } from './events/router-events.js'
import { isStoreError, type RouterStore } from './store/router-store.js'
import type { LeaseLedger } from './leases/ledger.js'
import { openCore } from './core.js'
import { adminRoutes } from './routes/admin.js'
import { agentStreamRoutes } from './routes/agent-stream.js'
import { completionRoutes } from './routes/completions.js'
import { faultToleranceRoutes } from './routes/fault-tolerance.js'
import { topologyRoutes } from './routes/topology.js'
import { healthRoutes } from './routes/health.js'
import { metricsRoutes } from './routes/metrics.js'
import { modelRoutes } from './routes/models.js'
import { TopologyRegistry } from './topology/registry.js'
import type { KvIndexer } from './routing/kv-indexer.js'
import { startDiscovery, type Discovery } from './discovery/index.js'
import { agentPlane, dataPlane, listenPlanes, operationsPlane } from './planes.js'

export interface RouterDeps {
  config: RouterConfig
  clock?: Clock
  random?: Random
  /** A pino logger to use instead of one built from the config (tests pass a sink). */
  logger?: FastifyBaseLogger
  /** Another lease ledger (default: a MemoryLeaseLedger from `config.leases`). */
  ledger?: LeaseLedger
  /** Skip the background prober (tests that drive health by hand). */
  probe?: boolean
}

// A client's X-Request-Id is kept only if it is a sane token: it ends up in logs and upstream headers.
const REQUEST_ID = /^[A-Za-z0-9._:-]{1,128}$/

/** 503 with Retry-After: a control write the shared store cannot take now. */
function storeUnavailable(reason: string): CodedError & { code: RouterErrorCode } {
  return Object.assign(new RTR_ERR_STORE_UNAVAILABLE(reason), { retryAfterSeconds: 1 })
}

/** Maps fastify's own errors (parsing, validation, limits) onto router codes. */
function toRouterError(err: FastifyError, bodyLimit: number, contentType: string | undefined): CodedError & { code: RouterErrorCode } {
  if (isRouterError(err)) return err
  if (isStoreError(err)) return storeUnavailable(err.message)
  if (err.validation) return new RTR_ERR_INVALID_REQUEST(`${err.validationContext ?? 'body'}${err.message.replace(/^(body|querystring|params|headers)/, '')}`)
  switch (err.code) {
    case 'FST_ERR_CTP_INVALID_JSON_BODY':
    case 'FST_ERR_CTP_EMPTY_JSON_BODY':
      return new RTR_ERR_INVALID_JSON(err.message, { cause: err })
    case 'FST_ERR_CTP_BODY_TOO_LARGE':
      return new RTR_ERR_BODY_TOO_LARGE(bodyLimit, { cause: err })
    case 'FST_ERR_CTP_INVALID_MEDIA_TYPE':
      return new RTR_ERR_UNSUPPORTED_MEDIA_TYPE(JSON.stringify(contentType ?? ''), { cause: err })
  }
  if (err instanceof SyntaxError) return new RTR_ERR_INVALID_JSON(err.message, { cause: err })
  if (err.statusCode === 400) return new RTR_ERR_INVALID_REQUEST(err.message, { cause: err })
  return new RTR_ERR_INTERNAL(err.message, { cause: err })
}

/**
 * Builds the router, not yet listening: the core (core.ts: topology, store, events, leases,
 * proxy, prober) behind the planes (planes.ts: data, operations, agents, probes), with the
 * hooks that tie them to fastify's life (graceful close, the prober's leadership, discovery)
 * and the one error mapping. Everything is closed in onClose, so tests can build isolated
 * routers; listenPlanes() starts the listeners of planes that have ports of their own.
 */
export async function buildApp(deps: RouterDeps): Promise<FastifyInstance> {
  const { config } = deps
  const clock = deps.clock ?? systemClock
  const random = deps.random ?? systemRandom
  const app = Fastify({
    ...(deps.logger ? { loggerInstance: withRequestSerializers(deps.logger as Logger) as FastifyBaseLogger } : { logger: loggerOptions({ name: 'router', level: config.logLevel }) }),
    bodyLimit: config.limits.bodyBytes,
    requestIdHeader: false,
    genReqId: (req) => {
      const given = req.headers['x-request-id']
      return typeof given === 'string' && REQUEST_ID.test(given) ? given : randomUUID()
    },
    return503OnClosing: false,
    // Requests are forwarded as sent: never coerce, strip or default a field.
    ajv: { customOptions: { coerceTypes: false, removeAdditional: false, useDefaults: false, allErrors: false } },
    // Each schema compiled once per process, not once per app and route (common/schema-compilers.ts).
    schemaController: processSchemaController,
  })
  for (const s of sharedSchemas) app.addSchema(s)
  // Only JSON is accepted: without this, text/plain would be parsed as a string and fail
  // validation as a 400 instead of the documented 415.
  app.removeContentTypeParser('text/plain')
  limitJsonDepth(app)

  const core = await openCore(config, { clock, random, log: app.log, ...(deps.ledger ? { ledger: deps.ledger } : {}) })
  const { registry, metrics, store, shared, events, ledger, drainer, pairs, proxy, prober } = core
  // Graceful close: server.close() waits for every open connection, and a keep-alive
  // connection can linger until its timeout (72 s) even when no response is in progress.
  // Responses in flight are counted, and once none is left while closing, every connection
  // is closed so shutdown completes as soon as the last stream ends.
  let closing = false
  let activeResponses = 0
  const closeConnectionsIfDrained = (): void => {
    if (!closing || activeResponses > 0) return
    app.server.closeAllConnections()
    for (const s of app.planeServers) s.closeAllConnections()
  }
  app.addHook('preClose', async () => {
    closing = true
    closeConnectionsIfDrained()
  })
  app.addHook('onRequest', async (req, reply) => {
    activeResponses++
    reply.raw.once('close', () => {
      activeResponses--
      // After the response's own bytes are flushed; 'close' fires once the socket is done with it.
      if (closing) setImmediate(closeConnectionsIfDrained)
    })
    // While closing, agents may still acknowledge events (the streams wait for them).
    if (closing && !(req.method === 'POST' && req.url.startsWith('/v1/agents/') && req.url.endsWith('/acks'))) {
      reply.header('connection', 'close')
      throw new RTR_ERR_SHUTTING_DOWN()
    }
    reply.header('x-request-id', req.id)
  })
  // One router probes: this one alone, or the prober leader among several on one store. While
  // the store is unreachable every router probes for itself (it cannot hear the leader).
  let probing = false
  let serving = false
  const updateProber = (): void => {
    metrics.proberLeader.set(store.leadership.isLeader ? 1 : 0)
    const should = serving && deps.probe !== false && (store.leadership.isLeader || store.state.state !== 'ok')
    if (should === probing) return
    probing = should
    if (should) {
      // A new leader's first round goes to every router, changed or not.
      void prober.probeAll().then(() => shared?.publishVerdicts())
      prober.start()
    } else prober.stop()
  }
  const unsubscribeStore = [store.leadership.onChange(updateProber), store.onChange(updateProber)]
  // Discovery before the first probe round, so pods there at start-up are probed in it. A
  // discovery that cannot work (RBAC, credentials) fails start-up: listen() rejects.
  let discovery: Discovery | undefined
  app.addHook('onReady', async () => {
    if (!config.discovery) return
    discovery = await startDiscovery(config.discovery, {
      clock,
      random,
      metrics: metrics.registry,
      logger: app.log.child({ component: 'discovery' }),
      target: {
        has: (id) => registry.has(id),
        discovered: (id) => registry.describe(id)?.source === 'kubernetes',
        add: (cfg) => {
          registry.add(cfg, 'kubernetes')
          if (deps.probe !== false) void prober.probe(cfg.id)
        },
        drain: async (id, opts) => drainer.drain(id, opts),
        remove: async (id, reason) => drainer.remove(id, reason),
        onRemoved: (listener) =>
          registry.subscribe((change) => {
            if (change.type === 'removed') listener(change.instanceId)
          }),
      },
    })
  })
  app.addHook('onReady', async () => {
    // One round before serving, so /v1/models and health are known from the first request.
    if (deps.probe !== false && store.leadership.isLeader) await prober.probeAll()
    serving = true
    updateProber()
    // Every router follows the engines' load for its own limits (they count its own requests).
    if (deps.probe !== false) core.limits.start()
  })
  app.addHook('onClose', async () => {
    serving = false
    for (const u of unsubscribeStore) u()
    await discovery?.stop()
    await Promise.all(app.planeServers.map((p) => new Promise((resolve) => p.close(resolve))))
    await core.close()
  })

  app.setErrorHandler((err: FastifyError, req, reply) => {
    const mapped = toRouterError(err, config.limits.bodyBytes, req.headers['content-type'])
    const status = mapped.statusCode ?? 500
    if (status >= 500) req.log.error({ err, code: mapped.code }, mapped.message)
    else req.log.info({ code: mapped.code }, mapped.message)
    if (reply.raw.headersSent) {
      reply.raw.destroy()
      return
    }
    const retryAfter = (mapped as { retryAfterSeconds?: number }).retryAfterSeconds
    if (retryAfter !== undefined) reply.header('retry-after', String(retryAfter))
    return reply.code(status).send(errorBody(mapped))
  })
  app.setNotFoundHandler((req, reply) => {
    const err = new RTR_ERR_ROUTE_NOT_FOUND(`${req.method} ${req.url.split('?')[0]}`)
    return reply.code(404).send(errorBody(err))
  })

  // Probes: public, on every listener.
  await app.register(healthRoutes, { registry, isClosing: () => closing, store: () => ({ kind: store.kind, routerId: store.routerId, ...store.state }) })
  await app.register(metricsRoutes, {
    registry: metrics.registry,
    beforeScrape: () => {
      const agents = events.agents.all()
      const connected = agents.filter((a) => a.streams > 0).length
      metrics.agents.set({ state: 'connected' }, connected)
      metrics.agents.set({ state: 'disconnected' }, agents.length - connected)
      metrics.agentStreamUnsent.set(core.agentStreams.unsent())
    },
  })
  // The planes (planes.ts), each with its listener and credential checked in its own scope.
  await app.register(dataPlane(config, async (v1) => {
    await v1.register(modelRoutes, { registry, startedAt: clock.now(), card: (model) => core.prober.card(model) })
    await v1.register(completionRoutes, { proxy })
  }, {}))
  // Writes the other routers must see are refused while the store cannot take them.
  const storeWritable = async (req: { method: string }): Promise<void> => {
    const state = store.state
    if (req.method !== 'GET' && state.state !== 'ok') throw storeUnavailable(state.error ?? `unreachable since ${new Date(state.since).toISOString()}`)
  }
  await app.register(
    agentPlane(config, agentStreamRoutes, {
      events,
      ...(shared ? { presence: shared } : {}),
      beforeRegister: storeWritable,
      onStreams: (streams) => core.setAgentStreams(streams),
      credentials: config.agentToken ? [config.agentToken] : config.apiKeys,
      keepAliveMs: config.events.keepAliveMs,
      streamBufferBytes: config.events.streamBufferBytes,
      onCut: (reason) => metrics.agentStreamsCut.inc({ reason }),
      drainMs: Math.min(config.shutdownGraceMs, 5000),
    }),
  )
  await app.register(
    operationsPlane(
      config,
      async (ops) => {
        await ops.register(faultToleranceRoutes, { events })
        await ops.register(topologyRoutes, { registry, events, pairing: config.pairing, pairs })
        await ops.register(adminRoutes, { registry, drainer, ledger, clock, probe: (id) => prober.probe(id) })
      },
      {},
      storeWritable,
    ),
  )

  app.decorate('planeServers', [] as Server[])
  app.decorate('listenPlanes', () => listenPlanes(app, config))
  app.decorate('topology', registry)
  app.decorate('routerStore', store)
  app.decorate('events', events)
  app.decorate('leases', ledger)
  app.decorate('kv', core.kv)
  app.decorate('discovery', () => discovery)
  return app
}

declare module 'fastify' {
  interface FastifyInstance {
    topology: TopologyRegistry
    routerStore: RouterStore
    events: RouterEvents
    leases: LeaseLedger
    /** The prefix index built from the engines' KV events. */
    kv: KvIndexer
    /** The running discovery, once the app is ready (undefined without `discovery` config). */
    discovery: () => Discovery | undefined
  }
}
