import { randomBytes } from 'node:crypto'
import Fastify, { type FastifyInstance } from 'fastify'
import type { AgentAttach, AgentEvent, LeaseRequest, PullRequest } from '../../schemas/agent-api.js'

/**
 * A transfer agent's engine API (schemas/agent-api.ts) over loopback HTTP, in process and
 * without NIXL: it "maps" an engine's region by looking its engine id up in `memories`, and a
 * pull copies block bytes from the peer fake agent found at remote_host:remote_port. Tests
 * script failures with `onPull`, end leases and quiesce pulls by hand, and `restart()` it
 * (a new agentId, nothing attached, no leases, events from seq 0).
 */
export type PullScript = (body: PullRequest, signal: AbortSignal) => Promise<{ status: number; code: string; tainted: boolean; quiesce: boolean } | undefined>

export class FakeAgent {
  agentId = randomBytes(4).toString('hex')
  attached: AgentAttach | undefined
  readonly leases = new Map<string, number[]>()
  readonly pulls: PullRequest[] = []
  readonly calls: string[] = []
  onPull: PullScript | undefined
  /** Every lease call answers this error while set. */
  failLeases: { status: number; code: string } | undefined
  /** 409 XFA_ERR_NOT_ATTACHED on every engine call while set. */
  detached = false
  readonly app: FastifyInstance
  #events: AgentEvent[] = []
  #seq = 0
  #wake = new Set<() => void>()
  port = 0

  constructor(
    readonly memories: Map<string, Uint8Array>,
    readonly peers: Map<number, FakeAgent>,
  ) {
    this.app = Fastify()
    this.app.addHook('onRequest', async (req) => void this.calls.push(`${req.method} ${req.url.split('?')[0]}`))
    this.app.post<{ Body: AgentAttach }>('/v1/engine/attach', async (req) => {
      this.attached = req.body
      this.detached = false
      return { agentId: this.agentId, engineId: req.body.engineId, peerHost: '127.0.0.1', peerPort: this.port, leaseSeconds: 30 }
    })
    this.app.post<{ Body: LeaseRequest }>('/v1/leases', async (req, reply) => {
      if (!this.attached || this.detached) return reply.code(409).send({ error: { code: 'XFA_ERR_NOT_ATTACHED', message: 'no engine' } })
      if (this.failLeases) return reply.code(this.failLeases.status).send({ error: { code: this.failLeases.code, message: 'scripted' } })
      if (this.leases.has(req.body.requestId)) return reply.code(409).send({ error: { code: 'XFA_ERR_LEASE_EXISTS', message: 'leased' } })
      this.leases.set(req.body.requestId, req.body.blockIds)
      return reply.code(201).send({ requestId: req.body.requestId, expiresAt: performance.now() / 1000 + 30, leaseSeconds: 30 })
    })
    this.app.delete<{ Params: { id: string } }>('/v1/leases/:id', async (req) => ({ released: this.endLease(req.params.id, 'released') }))
    this.app.post<{ Body: PullRequest }>('/v1/pulls', async (req, reply) => {
      if (!this.attached || this.detached) return reply.code(409).send({ error: { code: 'XFA_ERR_NOT_ATTACHED', message: 'no engine' } })
      const body = req.body
      this.pulls.push(body)
      const gone = new AbortController()
      reply.raw.once('close', () => gone.abort())
      const scripted = await this.onPull?.(body, gone.signal)
      if (scripted) {
        if (scripted.quiesce) this.quiesce(body.requestId)
        return reply.code(scripted.status).send({ error: { code: scripted.code, message: 'scripted' }, invalidBlockIds: body.localBlockIds, tainted: scripted.tainted })
      }
      const peer = this.peers.get(body.remotePort)
      const from = peer?.attached && this.memories.get(peer.attached.engineId)
      if (!peer || !from || !peer.leases.has(body.remoteRequestId)) {
        this.quiesce(body.requestId)
        return reply.code(410).send({ error: { code: 'XFA_ERR_KV_EXPIRED', message: 'no lease' }, invalidBlockIds: body.localBlockIds, tainted: false })
      }
      const to = this.memories.get(this.attached.engineId) as Uint8Array
      const bb = this.attached.blockSize * this.attached.bytesPerToken
      body.localBlockIds.forEach((local, i) => {
        const remote = body.remoteBlockIds[i] as number
        to.set(from.subarray(remote * bb, (remote + 1) * bb), local * bb)
      })
      peer.endLease(body.remoteRequestId, 'read_done')
      return { requestId: body.requestId, bytes: body.localBlockIds.length * bb, readMicros: 1, pullMicros: 2 }
    })
    this.app.get<{ Querystring: { after?: string; waitMs?: string } }>('/v1/engine/events', async (req) => {
      const after = Number(req.query.after ?? 0)
      this.#events = this.#events.filter((e) => e.seq > after)
      if (this.#events.length === 0) {
        await new Promise<void>((resolve) => {
          const done = (): void => {
            clearTimeout(timer)
            this.#wake.delete(done)
            resolve()
          }
          const timer = setTimeout(done, Number(req.query.waitMs ?? 0))
          this.#wake.add(done)
        })
      }
      const events = this.#events.filter((e) => e.seq > after)
      return { agentId: this.agentId, events, last: events.at(-1)?.seq ?? after }
    })
  }

  async listen(): Promise<void> {
    await this.app.listen({ host: '127.0.0.1', port: this.port })
    this.port = (this.app.server.address() as { port: number }).port
    this.peers.set(this.port, this)
  }

  get url(): string {
    return `http://127.0.0.1:${this.port}`
  }

  endLease(requestId: string, reason: 'read_done' | 'released' | 'expired'): boolean {
    const blockIds = this.leases.get(requestId)
    if (!blockIds) return false
    this.leases.delete(requestId)
    this.#push({ type: 'lease_ended', requestId, blockIds, reason })
    return true
  }

  quiesce(requestId: string): void {
    const pull = this.pulls.find((p) => p.requestId === requestId)
    this.#push({ type: 'pull_quiesced', requestId, blockIds: pull?.localBlockIds ?? [] })
  }

  /** A new process at the same address: new agentId, nothing attached, no leases, seq from 0. */
  restart(): void {
    this.agentId = randomBytes(4).toString('hex')
    this.attached = undefined
    this.leases.clear()
    this.#events = []
    this.#seq = 0
  }

  #push(e: { type: 'lease_ended'; requestId: string; blockIds: number[]; reason: 'read_done' | 'released' | 'expired' } | { type: 'pull_quiesced'; requestId: string; blockIds: number[] }): void {
    this.#events.push({ ...e, seq: ++this.#seq } as AgentEvent)
    for (const w of [...this.#wake]) w()
  }
}
