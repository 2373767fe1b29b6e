import { createHash, timingSafeEqual } from 'node:crypto'
import Fastify, { type FastifyBaseLogger, type FastifyError, type FastifyInstance } from 'fastify'
import { pino, type Logger } from 'pino'
import { Registry } from 'prom-client'
import { processSchemaController } from '../../common/schema-compilers.js'
import { systemClock, type Clock } from '../../common/clock.js'
import { loggerOptions } from '../../common/logger.js'
import { systemRandom, type Random } from '../../common/random.js'
import { sharedSchemas } from '../../schemas/index.js'
import type { SimConfig } from '../../schemas/sim-config.js'
import { BlockPool, type BlockEvent } from './block-pool.js'
import { kvEventsConfigOf } from './config.js'
import type { SimContext } from './context.js'
import { SimEngine } from './engine.js'
import { AgentClient } from './agent-client.js'
import { AgentLink } from './agent-link.js'
import { SIM_ERR_INVALID_CONFIG, SIM_ERR_NOT_FOUND, SIM_ERR_SHUTTING_DOWN, SIM_ERR_UNAUTHORIZED } from './errors.js'
import { FaultState } from './faults.js'
import { KvEventPublisher } from './kv-events.js'
import { KvRegion } from './kv-region.js'
import type { KvTransport, KvTransportDeps, KvTransportFactory } from './kv-source.js'
import { createSimMetrics } from './metrics.js'
import { RequestLog } from './request-log.js'
import { SeqSlots } from './seq-slots.js'
import { completionRoutes } from './routes/completions.js'
import { infoRoutes } from './routes/info.js'
import { simAdminRoutes } from './routes/sim-admin.js'
import { tokenizeRoutes } from './routes/tokenize.js'

export interface SimDeps {
  config: Readonly<SimConfig>
  clock?: Clock
  random?: Random
  /** A pino logger; tests pass one writing to a sink (or level 'silent'). */
  logger?: Logger
  registry?: Registry
  /** Backing memory of the KV region (main.ts maps shared memory for `--kv agent`). */
  kvMemory?: ArrayBuffer | Uint8Array
  /**
   * `--kv agent`: the POSIX name of `kvMemory`'s shared-memory object, sent to the agent
   * (default: config.shmName). Ignored by a `kvTransport` that needs none.
   */
  shmName?: string
  /** `--kv agent`: how KV moves; default an AgentLink to `config.agentUrl` (tests pass doubles). */
  kvTransport?: KvTransportFactory
  exit?: (code: number) => void
}

/** The transfer-agent link for `--kv agent` (its events loop starts with the app). */
function agentTransport(config: Readonly<SimConfig>, shmName: string | undefined): KvTransportFactory {
  return (d: KvTransportDeps): KvTransport => {
    if (config.agentUrl === undefined) throw new SIM_ERR_INVALID_CONFIG('--kv agent needs --agent-url')
    if (shmName === undefined) throw new SIM_ERR_INVALID_CONFIG('--kv agent needs the KV region in shared memory (--shm-name)')
    const link = new AgentLink({
      client: new AgentClient({ url: config.agentUrl, ...(config.agentToken ? { token: config.agentToken } : {}) }),
      attach: {
        engineId: d.engineId,
        role: config.role,
        shmName,
        blockSize: d.region.blockSize,
        bytesPerToken: d.region.bytesPerToken,
        numBlocks: d.region.numBlocks,
        // Port 0 is only known after listen; the agent does not need it.
        ...(config.port !== 0 ? { engineUrl: `http://${config.host}:${config.port}` } : {}),
      },
      pool: d.pool,
      metrics: d.metrics,
      clock: d.clock,
      log: d.log.child({ component: 'agent-link' }),
      leaseSeconds: config.leaseSeconds,
    })
    link.start()
    return link
  }
}

interface Rank {
  rank: number
  engineId: string
}

/**
 * The data-parallel ranks this process serves, each its own engine: vLLM names a rank's
 * engine `<engine_id>_dp<rank>` whenever data parallel is on (a size above 1, or a rank above
 * 0; vLLM 0.32 v1/engine/core.py run_engine_core), and leaves one engine's id alone.
 */
function dataParallelRanks(config: Readonly<SimConfig>, base: string): Rank[] {
  const own = config.dataParallelRank
  const dp = config.dataParallelSize > 1 || (own ?? 0) > 0
  const ranks = own !== undefined ? [own] : Array.from({ length: config.dataParallelSize }, (_, r) => r)
  return ranks.map((rank) => ({ rank, engineId: dp ? `${base}_dp${rank}` : base }))
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

declare module 'fastify' {
  interface FastifyInstance {
    /** `--kv agent`: how KV moves (main.ts waits for it to be ready); null otherwise. */
    simKv: KvTransport | null
  }
}

/** The simulator as a fastify instance, not yet listening. */
export function buildApp(deps: SimDeps): FastifyInstance {
  const { config } = deps
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
    // Each schema compiled once per process, not once per app and route (common/schema-compilers.ts).
    schemaController: processSchemaController,
  })
  for (const s of sharedSchemas) app.addSchema(s)

  const region = deps.kvMemory
    ? new KvRegion({ memory: deps.kvMemory, blockSize: config.blockSize, bytesPerToken: config.bytesPerToken, numBlocks: config.numGpuBlocksOverride })
    : KvRegion.allocate({ blockSize: config.blockSize, bytesPerToken: config.bytesPerToken, numBlocks: config.numGpuBlocksOverride })
  const eventsConfig = kvEventsConfigOf(config)
  const pool = new BlockPool({
    numBlocks: config.numGpuBlocksOverride,
    blockSize: config.blockSize,
    enableCaching: config.enablePrefixCaching,
    hashSeed: Math.floor(random.next() * 0x1_0000_0000),
    // ctx.kvEvents is set once the publisher is open (onReady, below); no event comes before traffic.
    ...(eventsConfig ? { onEvent: (e: BlockEvent) => ctx.kvEvents?.emit(e) } : {}),
  })
  const metrics = createSimMetrics({ registry, model: config.model, kvUsage: () => pool.usedCount / pool.numBlocks })
  const ranks = dataParallelRanks(config, config.engineId ?? `sim-${random.hex(8)}`)
  // With --kv agent there is one rank (config.ts): the agent serves that engine.
  const engineId = (ranks[0] as Rank).engineId
  const kv =
    config.kv === 'agent'
      ? (deps.kvTransport ?? agentTransport(config, deps.shmName ?? config.shmName))({ engineId, region, pool, metrics, clock, log: logger })
      : undefined
  const engines = ranks.map((rank) => new SimEngine({
    role: config.role,
    engineId: rank.engineId,
    kvMode: config.kv,
    vllmCompat: config.vllmCompat,
    prefillDelayMs: config.prefillDelayMs,
    decodeQueueMs: config.decodeQueueMs,
    announcePulls: !config.skipPullExpectations,
    leaseSeconds: config.leaseSeconds,
    sideChannelHost: config.sideChannelHost,
    sideChannelPort: config.sideChannelPort + rank.rank,
    clock,
    random,
    region,
    pool,
    metrics,
    ...(kv ? { kv } : {}),
    kvLoadFailurePolicy: config.kvLoadFailurePolicy,
  }))
  const shutdown = new AbortController()
  const ctx: SimContext = {
    config,
    clock,
    random,
    engines,
    nextRank: 0,
    region,
    pool,
    kvEvents: undefined,
    kv,
    faults: new FaultState(config.faults),
    metrics,
    requests: new RequestLog(100),
    inFlightIds: new Set(),
    seqs: new SeqSlots(config.maxNumSeqs),
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

  app.decorate('simKv', kv ?? null)
  app.register(completionRoutes, ctx)
  app.register(infoRoutes, ctx)
  app.register(simAdminRoutes, ctx)
  app.register(tokenizeRoutes, ctx)

  // preClose, not onClose: the server waits for open connections before onClose runs, so a
  // stalled request would otherwise hold shutdown for its whole stall.
  app.addHook('preClose', async () => {
    shutdown.abort(new SIM_ERR_SHUTTING_DOWN())
  })
  app.addHook('onClose', async () => {
    await kv?.close()
  })
  if (eventsConfig) {
    app.addHook('onReady', async () => {
      const publisher = await KvEventPublisher.open({
        config: eventsConfig,
        host: config.host,
        dataParallelRank: config.dataParallelRank ?? 0,
        blockSize: config.blockSize,
        clock,
        log: logger.child({ component: 'kv-events' }),
      })
      ctx.kvEvents = publisher
      app.log.info({ endpoint: publisher.endpoint, replayEndpoint: publisher.replayEndpoint }, 'publishing KV events')
    })
    app.addHook('onClose', async () => {
      await ctx.kvEvents?.close()
    })
  }
  app.log.info({ engineIds: ranks.map((r) => r.engineId), role: config.role, kv: config.kv, model: config.model }, 'simulator built')
  return app
}
