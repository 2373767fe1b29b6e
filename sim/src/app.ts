import { createHash, timingSafeEqual } from 'node:crypto'
import Fastify, { type FastifyBaseLogger, type FastifyError, type FastifyInstance } from 'fastify'
import { pino, type Logger } from 'pino'
import { Registry } from 'prom-client'
import { systemClock, type Clock } from '../../common/clock.js'
import { loggerOptions } from '../../common/logger.js'
import { systemRandom, type Random } from '../../common/random.js'
import { sharedSchemas } from '../../schemas/index.js'
import type { SimConfig } from '../../schemas/sim-config.js'
import { BlockAllocator } from './block-allocator.js'
import type { SimContext } from './context.js'
import { SimEngine } from './engine.js'
import { SIM_ERR_KV_MODE_UNSUPPORTED, SIM_ERR_NOT_FOUND, SIM_ERR_SHUTTING_DOWN, SIM_ERR_UNAUTHORIZED } from './errors.js'
import { FaultState } from './faults.js'
import { KvRegion } from './kv-region.js'
import type { KvSource } from './kv-source.js'
import { LeaseTable } from '../../common/lease-table.js'
import { createSimMetrics } from './metrics.js'
import { RequestLog } from './request-log.js'
import { completionRoutes } from './routes/completions.js'
import { infoRoutes } from './routes/info.js'
import { simAdminRoutes } from './routes/sim-admin.js'

export interface SimDeps {
  config: Readonly<SimConfig>
  clock?: Clock
  random?: Random
  /** A pino logger; tests pass one writing to a sink (or level 'silent'). */
  logger?: Logger
  registry?: Registry
  /** Backing memory of the KV region (a shared-memory mapping in `--kv agent` mode). */
  kvMemory?: ArrayBuffer | Uint8Array
  /** How a decoder pulls remote blocks; required by `--kv agent`. */
  kvSource?: KvSource
  exit?: (code: number) => void
}

/** OpenAI error `type` per status, as vLLM names them. */
function errorType(status: number): string {
  if (status === 401) return 'AuthenticationError'
  if (status === 404) return 'NotFoundError'
  if (status === 413) return 'RequestEntityTooLargeError'
  if (status < 500) return 'BadRequestError'
  if (status === 503) return 'ServiceUnavailableError'
  return 'InternalServerError'
}

/** The simulator as a fastify instance, not yet listening. */
export function buildApp(deps: SimDeps): FastifyInstance {
  const { config } = deps
  if (config.kv === 'agent' && !deps.kvSource) throw new SIM_ERR_KV_MODE_UNSUPPORTED(config.kv)
  const clock = deps.clock ?? systemClock
  const random = deps.random ?? systemRandom
  const logger = deps.logger ?? pino(loggerOptions({ name: 'sim', level: config.logLevel }))
  const registry = deps.registry ?? new Registry()

  const app = Fastify({
    loggerInstance: logger as FastifyBaseLogger,
    bodyLimit: config.bodyLimit,
    keepAliveTimeout: config.keepAliveMs,
    requestIdHeader: 'x-request-id',
    // vLLM's fallback id: a random uuid4 in hex.
    genReqId: () => random.hex(16),
    ajv: {
      // Validate without rewriting: a simulator that coerced or stripped fields would hide
      // the router bugs it exists to expose.
      customOptions: { removeAdditional: false, coerceTypes: false, useDefaults: false, allErrors: false },
    },
  })
  for (const s of sharedSchemas) app.addSchema(s)

  const region = deps.kvMemory
    ? new KvRegion({ memory: deps.kvMemory, blockSize: config.blockSize, bytesPerToken: config.bytesPerToken, numBlocks: config.numBlocks })
    : KvRegion.allocate({ blockSize: config.blockSize, bytesPerToken: config.bytesPerToken, numBlocks: config.numBlocks })
  const allocator = new BlockAllocator(config.numBlocks)
  const metrics = createSimMetrics({ registry, model: config.model, kvUsage: () => allocator.usedCount / allocator.numBlocks })
  const leases = new LeaseTable<readonly number[]>({
    clock,
    leaseMs: config.leaseSeconds * 1000,
    onEnd: (lease, reason) => {
      allocator.free(lease.value)
      if (reason === 'expired') {
        metrics.kvExpired.inc(metrics.labels)
        app.log.warn({ remoteRequestId: lease.id, reads: lease.reads }, 'Releasing expired KV blocks')
      }
    },
  })
  const engineId = config.engineId ?? `sim-${random.hex(8)}`
  const engine = new SimEngine({
    role: config.role,
    engineId,
    kvMode: config.kv,
    vllmCompat: config.vllmCompat,
    prefillDelayMs: config.prefillDelayMs,
    sideChannelHost: config.sideChannelHost,
    sideChannelPort: config.sideChannelPort,
    clock,
    random,
    region,
    allocator,
    leases,
    metrics,
    ...(deps.kvSource ? { kvSource: deps.kvSource } : {}),
  })
  const shutdown = new AbortController()
  const ctx: SimContext = {
    config,
    clock,
    random,
    engine,
    region,
    allocator,
    leases,
    faults: new FaultState(config.faults),
    metrics,
    requests: new RequestLog(100),
    inFlightIds: new Set(),
    shutdown: shutdown.signal,
    exit: deps.exit ?? ((code) => process.exit(code)),
  }

  if (config.apiKey !== undefined) {
    // vLLM's authentication middleware: only paths under /v1 need the key, OPTIONS never.
    const expected = createHash('sha256').update(`Bearer ${config.apiKey}`).digest()
    app.addHook('onRequest', async (request) => {
      const path = request.url.split('?')[0] ?? request.url
      if (request.method === 'OPTIONS' || !path.startsWith('/v1')) return
      const given = createHash('sha256').update(request.headers.authorization ?? '').digest()
      if (!timingSafeEqual(given, expected)) throw new SIM_ERR_UNAUTHORIZED()
    })
  }

  app.addHook('preValidation', async (request) => {
    const path = request.url.split('?')[0] ?? request.url
    if (path.startsWith('/sim/') || path === '/health' || path === '/metrics') return
    const xRequestId = request.headers['x-request-id']
    ctx.requests.add(
      {
        receivedAt: clock.now(),
        method: request.method,
        path,
        xRequestId: typeof xRequestId === 'string' ? xRequestId : null,
        headers: { ...request.headers },
        body: request.body,
      },
      request.raw,
    )
  })

  app.setErrorHandler((err: FastifyError, request, reply) => {
    // The client left (a router aborting its leg): nothing to answer and nothing went wrong here.
    if (reply.raw.destroyed || request.raw.socket?.destroyed) {
      request.log.info({ reason: err.message }, 'client went away')
      return
    }
    const status = err.validation ? 400 : (err.statusCode ?? 500)
    if (status >= 500) request.log.error({ err }, 'request failed')
    else request.log.info({ code: err.code, msg: err.message }, 'request rejected')
    const code = err.validation ? 'SIM_ERR_BAD_REQUEST' : (err.code ?? (status >= 500 ? 'SIM_ERR_INTERNAL' : 'SIM_ERR_BAD_REQUEST'))
    return reply.code(status).send({ error: { message: err.message, type: errorType(status), param: null, code } })
  })
  app.setNotFoundHandler((request, reply) => {
    const err = new SIM_ERR_NOT_FOUND(request.method, request.url)
    return reply.code(404).send({ error: { message: err.message, type: 'NotFoundError', param: null, code: err.code } })
  })

  app.register(completionRoutes, ctx)
  app.register(infoRoutes, ctx)
  app.register(simAdminRoutes, ctx)

  if (config.kv === 'agent') leases.start()
  // preClose, not onClose: the server waits for open connections before onClose runs, so a
  // stalled request would otherwise hold shutdown for its whole stall.
  app.addHook('preClose', async () => {
    shutdown.abort(new SIM_ERR_SHUTTING_DOWN())
  })
  app.addHook('onClose', async () => {
    leases.stop()
  })
  app.log.info({ engineId, role: config.role, kv: config.kv, model: config.model }, 'simulator built')
  return app
}
