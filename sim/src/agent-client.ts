import type { ValidateFunction } from 'ajv'
import { Agent, type Dispatcher } from 'undici'
import { errorWithDetails } from '../../common/coded-error.js'
import type { AgentAttach, AgentAttached, AgentEvents, LeaseGranted, LeaseRequest, PullDone, PullExpected, PullExpectation, PullRequest } from '../../schemas/agent-api.js'
import { createAjv, describeErrors } from '../../schemas/ajv.js'
import { simErrors } from './errors.js'

/**
 * The engine's side of the transfer agent's loopback API (schemas/agent-api.ts): one undici
 * Agent with keep-alive, every answer parsed and checked against its schema, every failure a
 * SIM_ERR_AGENT_CALL carrying what the agent said.
 */
export interface AgentCallDetails {
  /** The agent's `error.code` (XFA_ERR_*), or the socket's (ECONNREFUSED, UND_ERR_SOCKET, ...). */
  agentCode: string
  /** The HTTP status when the agent answered; absent when it never did. */
  agentStatus?: number
  /** A failed pull: the local blocks that hold no valid KV. */
  invalidBlockIds?: number[]
  /** A failed pull: a READ may still write into the blocks (wait for `pull_quiesced`). */
  tainted?: boolean
  /**
   * Whether the request may have reached the agent: false only when the connection was never
   * made, so the agent cannot be working on it.
   */
  sent: boolean
}

export type AgentCallError = Error & { code: 'SIM_ERR_AGENT_CALL' } & AgentCallDetails

export function isAgentCallError(err: unknown): err is AgentCallError {
  return err instanceof simErrors.SIM_ERR_AGENT_CALL
}

export interface AgentClientOptions {
  /** e.g. `http://127.0.0.1:7300` */
  url: string
  token?: string
  /** Bound on attach, lease and release calls (attach registers memory with NIXL: seconds). */
  timeoutMs?: number
}

// Errors raised before a single byte went out: the agent cannot be working on the call.
const NOT_SENT = new Set(['ECONNREFUSED', 'ENOTFOUND', 'EAI_AGAIN', 'EHOSTUNREACH', 'ENETUNREACH', 'UND_ERR_CONNECT_TIMEOUT'])

export class AgentClient {
  readonly #origin: string
  readonly #headers: Record<string, string>
  readonly #timeoutMs: number
  readonly #dispatcher: Agent
  readonly #validate: {
    attached: ValidateFunction<AgentAttached>
    lease: ValidateFunction<LeaseGranted>
    pull: ValidateFunction<PullDone>
    events: ValidateFunction<AgentEvents>
  }

  constructor(opts: AgentClientOptions) {
    const url = new URL(opts.url)
    if (url.protocol !== 'http:' && url.protocol !== 'https:') throw new TypeError(`agent url must be http(s), got ${opts.url}`)
    this.#origin = url.origin
    this.#headers = opts.token ? { authorization: `Bearer ${opts.token}` } : {}
    this.#timeoutMs = opts.timeoutMs ?? 30_000
    // Pulls and the events poll run at once: a few connections, kept alive (loopback).
    this.#dispatcher = new Agent({ connections: 32, keepAliveTimeout: 10_000, connect: { timeout: 5000 } })
    const ajv = createAjv({ useDefaults: false })
    const get = <T>(id: string): ValidateFunction<T> => {
      const v = ajv.getSchema<T>(id)
      if (!v) throw new Error(`${id} schema not registered`)
      return v
    }
    this.#validate = { attached: get('AgentAttached'), lease: get('LeaseGranted'), pull: get('PullDone'), events: get('AgentEvents') }
  }

  attach(body: AgentAttach, signal?: AbortSignal): Promise<AgentAttached> {
    return this.#call('POST', '/v1/engine/attach', body, this.#validate.attached, { timeoutMs: this.#timeoutMs, signal })
  }

  lease(body: LeaseRequest, signal?: AbortSignal): Promise<LeaseGranted> {
    return this.#call('POST', '/v1/leases', body, this.#validate.lease, { timeoutMs: this.#timeoutMs, signal })
  }

  /** Ends a lease early; `false` when the agent had none by that id. */
  async release(requestId: string, signal?: AbortSignal): Promise<boolean> {
    const path = `/v1/leases/${encodeURIComponent(requestId)}`
    const out = await this.#call<{ released: boolean }>('DELETE', path, undefined, undefined, { timeoutMs: this.#timeoutMs, signal })
    return out.released === true
  }

  /**
   * Resolves once the bytes are in the local blocks. No timeout of its own: the agent bounds
   * the READ by its deadline; `signal` (the engine's request) aborts the call, and the agent
   * then aborts the READ and reports `pull_quiesced`.
   */
  pull(body: PullRequest, signal: AbortSignal): Promise<PullDone> {
    return this.#call('POST', '/v1/pulls', body, this.#validate.pull, { timeoutMs: 0, signal })
  }

  /** The engine will pull P's request later: the agent heartbeats it meanwhile. */
  expect(body: PullExpected, signal?: AbortSignal): Promise<PullExpectation> {
    return this.#call('POST', '/v1/pulls/expected', body, undefined, { timeoutMs: this.#timeoutMs, signal })
  }

  /** Long poll: events after `after`, waiting up to `waitMs` for one. */
  events(after: number, waitMs: number, signal?: AbortSignal): Promise<AgentEvents> {
    const path = `/v1/engine/events?after=${after}&waitMs=${Math.round(waitMs)}`
    return this.#call('GET', path, undefined, this.#validate.events, { timeoutMs: waitMs + this.#timeoutMs, signal })
  }

  close(): Promise<void> {
    return this.#dispatcher.close()
  }

  async #call<T>(
    method: Dispatcher.HttpMethod,
    path: string,
    body: unknown,
    validate: ValidateFunction<T> | undefined,
    opts: { timeoutMs: number; signal: AbortSignal | undefined },
  ): Promise<T> {
    const what = `${method} ${path.split('?')[0]}`
    let res: Dispatcher.ResponseData
    try {
      res = await this.#dispatcher.request({
        origin: this.#origin,
        path,
        method,
        // No content-type without a body: fastify refuses an empty JSON body (a DELETE).
        ...(body === undefined ? { headers: this.#headers } : { headers: { ...this.#headers, 'content-type': 'application/json' }, body: JSON.stringify(body) }),
        ...(opts.signal ? { signal: opts.signal } : {}),
        headersTimeout: opts.timeoutMs,
        bodyTimeout: opts.timeoutMs,
      })
    } catch (cause) {
      const code = transportCode(cause)
      throw callError(`${what}: ${code}`, { agentCode: code, sent: !NOT_SENT.has(code), cause })
    }
    let text: string
    try {
      text = await res.body.text()
    } catch (cause) {
      const code = transportCode(cause)
      throw callError(`${what}: answered ${res.statusCode}, then ${code}`, { agentCode: code, agentStatus: res.statusCode, sent: true, cause })
    }
    let parsed: unknown
    try {
      parsed = JSON.parse(text)
    } catch {
      throw callError(`${what}: answered ${res.statusCode} with a body that is not JSON`, { agentCode: 'BAD_BODY', agentStatus: res.statusCode, sent: true })
    }
    if (res.statusCode >= 300) throw failure(what, res.statusCode, parsed)
    if (validate && !validate(parsed)) {
      throw callError(`${what}: bad answer: ${describeErrors(validate.errors)}`, { agentCode: 'BAD_BODY', agentStatus: res.statusCode, sent: true })
    }
    return parsed as T
  }
}

function callError(detail: string, details: AgentCallDetails & { cause?: unknown }): AgentCallError {
  return errorWithDetails(simErrors, 'SIM_ERR_AGENT_CALL', detail, details) as AgentCallError
}

/** An error status: the agent's `{error: {code, message}}`, plus a failed pull's block fields. */
function failure(what: string, status: number, body: unknown): AgentCallError {
  const b = (typeof body === 'object' && body !== null ? body : {}) as { error?: { code?: unknown; message?: unknown }; invalidBlockIds?: unknown; tainted?: unknown }
  const code = typeof b.error?.code === 'string' ? b.error.code : `HTTP_${status}`
  const message = typeof b.error?.message === 'string' ? b.error.message : ''
  const invalid = Array.isArray(b.invalidBlockIds) && b.invalidBlockIds.every((x) => Number.isInteger(x)) ? (b.invalidBlockIds as number[]) : undefined
  return callError(`${what}: ${status} ${code}${message ? `: ${message}` : ''}`, {
    agentCode: code,
    agentStatus: status,
    sent: true,
    ...(invalid ? { invalidBlockIds: invalid } : {}),
    ...(typeof b.tainted === 'boolean' ? { tainted: b.tainted } : {}),
  })
}

function transportCode(err: unknown): string {
  const e = err as { code?: unknown; name?: unknown; cause?: { code?: unknown } } | undefined
  if (typeof e?.code === 'string') return e.code
  if (typeof e?.cause?.code === 'string') return e.cause.code
  if (e?.name === 'AbortError') return 'ABORTED'
  return 'UNKNOWN'
}
