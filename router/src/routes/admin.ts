import type { FastifyPluginAsync } from 'fastify'
import type { Clock } from '../../../common/clock.js'
import type { InstanceConfig } from '../../../schemas/router-config.js'
import { RTR_ERR_INSTANCE_EXISTS } from '../errors.js'
import { DRAIN_ROUTE } from '../planes.js'
import type { LeaseLedger } from '../leases/ledger.js'
import type { Drainer } from '../topology/drainer.js'
import type { TopologyRegistry } from '../topology/registry.js'

/**
 * Autoscaler hooks and the lease summary, registered under the admin guard:
 * `POST /admin/instances` (an instance joins: the only way an address gets into the topology,
 * and so the only way the router comes to dial it), `POST /admin/instances/:id/drain`
 * (optionally waiting until drained, for a Kubernetes preStop hook), `DELETE
 * /admin/instances/:id`, and `GET /leases`. With a shared ledger the drain's unread count
 * reads Redis: while it cannot, the drain goes on and the answer is RTR_ERR_STORE_UNAVAILABLE.
 */
export interface AdminRoutesOptions {
  registry: TopologyRegistry
  drainer: Drainer
  ledger: LeaseLedger
  clock: Clock
  /** Probes a new instance once before answering, so its health and models are known. */
  probe(id: string): Promise<void>
}

const MAX_WAIT_MS = 600_000
const DEFAULT_WAIT_MS = 30_000

const idParams = {
  type: 'object',
  properties: { id: { type: 'string', minLength: 1, maxLength: 128, pattern: '^[A-Za-z0-9._:-]+$' } },
  required: ['id'],
} as const
const drainBody = {
  type: 'object',
  properties: { wait: { type: 'boolean' }, timeoutMs: { type: 'integer', minimum: 1, maximum: MAX_WAIT_MS } },
  additionalProperties: false,
} as const
const drainStatus = {
  type: 'object',
  properties: {
    id: { type: 'string' },
    drained: { type: 'boolean' },
    removed: { type: 'boolean' },
    inflight: { type: 'integer' },
    unreadLeases: { type: 'integer' },
    unheardRouters: { type: 'integer' },
    waitedMs: { type: 'integer' },
  },
  required: ['id', 'drained', 'removed', 'inflight', 'unreadLeases'],
} as const
const instanceView = {
  type: 'object',
  properties: {
    id: { type: 'string' },
    role: { type: 'string' },
    url: { type: 'string' },
    labels: { type: 'object', additionalProperties: { type: 'string' } },
    healthy: { type: 'boolean' },
    models: { type: ['array', 'null'], items: { type: 'string' } },
  },
  required: ['id', 'role', 'url', 'labels', 'healthy', 'models'],
} as const
const removed = {
  type: 'object',
  properties: { id: { type: 'string' }, peerGoneSeq: { type: ['integer', 'null'] }, engineIds: { type: 'array', items: { type: 'string' } } },
  required: ['id', 'peerGoneSeq', 'engineIds'],
} as const
const counts = { type: 'object', additionalProperties: { type: 'integer' } } as const
const leaseRecord = {
  type: 'object',
  properties: {
    requestId: { type: 'string' },
    clientRequestId: { type: 'string' },
    prefill: { type: 'string' },
    decode: { type: 'string' },
    engineId: { type: 'string' },
    remoteRequestId: { type: 'string' },
    state: { type: 'string' },
    issuedAt: { type: 'number' },
    expiresAt: { type: 'number' },
    abandonedAt: { type: 'number' },
    reason: { type: 'string' },
  },
  required: ['requestId', 'prefill', 'decode', 'engineId', 'state', 'issuedAt', 'expiresAt'],
} as const
const leaseSummary = {
  type: 'object',
  properties: {
    inFlight: { type: 'object', properties: { issued: { type: 'integer' }, reading: { type: 'integer' } }, required: ['issued', 'reading'] },
    byPrefill: counts,
    byDecode: counts,
    oldestAgeMs: { type: ['number', 'null'] },
    lapsed: {
      type: 'object',
      properties: { beforeDispatch: { type: 'integer' }, unread: { type: 'integer' }, afterDispatch: { type: 'integer' } },
      required: ['beforeDispatch', 'unread', 'afterDispatch'],
    },
    released: counts,
    abandoned: counts,
    entries: { type: 'integer' },
    leaseSeconds: { type: 'number' },
    leases: { type: 'array', items: leaseRecord },
    partial: { type: 'boolean' },
  },
  required: ['inFlight', 'byPrefill', 'byDecode', 'oldestAgeMs', 'lapsed', 'released', 'abandoned', 'entries', 'leaseSeconds'],
} as const

export const adminRoutes: FastifyPluginAsync<AdminRoutesOptions> = async (app, opts) => {
  const { registry, drainer, ledger } = opts

  app.post<{ Body: InstanceConfig }>('/admin/instances', { schema: { body: { $ref: 'InstanceConfig#' }, response: { 201: instanceView } } }, async (req, reply) => {
    const cfg = req.body
    if (registry.has(cfg.id)) throw new RTR_ERR_INSTANCE_EXISTS(cfg.id)
    registry.add(cfg)
    req.log.info({ instance: cfg.id, role: cfg.role, url: cfg.url }, 'instance registered')
    await opts.probe(cfg.id)
    const view = registry.snapshot().instances.find((i) => i.id === cfg.id)
    // Removed again while its first probe ran: say what was registered.
    if (!view) return reply.code(201).send({ id: cfg.id, role: cfg.role, url: cfg.url, labels: cfg.labels ?? {}, healthy: false, models: null })
    return reply.code(201).send({ ...view, models: view.models ? [...view.models] : null })
  })

  app.post<{ Params: { id: string }; Body: { wait?: boolean; timeoutMs?: number } }>(
    '/admin/instances/:id/drain',
    {
      // The one route engines' drain token opens (planes.ts).
      config: DRAIN_ROUTE,
      // `curl -X POST …/drain` sends no body at all: that is `{}`.
      preValidation: async (req) => {
        req.body ??= {}
      },
      schema: { params: idParams, body: drainBody, response: { 200: drainStatus, 202: drainStatus } },
    },
    async (req, reply) => {
      const { id } = req.params
      const started = opts.clock.monotonic()
      const now = await drainer.drain(id)
      if (!req.body.wait || now.drained || now.removed) return reply.code(req.body.wait ? 200 : 202).send(now)
      // The caller hanging up ends the wait (the drain itself goes on).
      const gone = new AbortController()
      reply.raw.once('close', () => gone.abort())
      const status = await drainer.wait(id, req.body.timeoutMs ?? DEFAULT_WAIT_MS, gone.signal)
      return reply.code(200).send({ ...status, waitedMs: Math.round(opts.clock.monotonic() - started) })
    },
  )

  app.delete<{ Params: { id: string } }>('/admin/instances/:id', { schema: { params: idParams, response: { 200: removed } } }, async (req) => {
    const result = await drainer.remove(req.params.id, `deregistered: instance ${req.params.id}`)
    req.log.info({ instance: req.params.id, engineIds: result.engineIds }, 'instance deregistered')
    return result
  })

  app.get<{ Querystring: { instance?: string } }>(
    '/leases',
    {
      schema: {
        querystring: { type: 'object', properties: { instance: idParams.properties.id }, additionalProperties: false },
        response: { 200: leaseSummary },
      },
    },
    async (req) => ledger.summary(req.query.instance !== undefined ? { instance: req.query.instance } : {}),
  )
}
