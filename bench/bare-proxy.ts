import { parseArgs } from 'node:util'
import Fastify from 'fastify'
import { Agent, request } from 'undici'
import { announceReady } from '../common/ready.js'
import { decodeBody, prefillBody } from '../router/src/proxy/legs.js'

/**
 * The floor for a two-leg proxy on this stack: fastify + undici doing the P and D legs with
 * the router's own body builders, and nothing else (no validation, selection, health, metrics,
 * error mapping or streaming). `handoff bench overhead` runs it beside the router so the
 * router's cost can be read against the cost of the stack itself.
 */
export async function runBareProxy(argv: string[]): Promise<void> {
  const { values } = parseArgs({ args: argv, options: { prefill: { type: 'string' }, decode: { type: 'string' } } })
  if (!values.prefill || !values.decode) throw new Error('usage: handoff bench bare-proxy --prefill URL --decode URL')
  const prefillUrl = values.prefill
  const decodeUrl = values.decode
  const agent = new Agent({ connections: 256, keepAliveTimeout: 30_000 })
  const app = Fastify({ logger: false, bodyLimit: 16 * 1024 * 1024 })
  const headers = { 'content-type': 'application/json' }
  app.post('/v1/completions', async (req, reply) => {
    const body = req.body as Record<string, unknown>
    const p = await request(`${prefillUrl}/v1/completions`, { method: 'POST', dispatcher: agent, headers, body: JSON.stringify(prefillBody(body)) })
    const params = ((await p.body.json()) as { kv_transfer_params?: Record<string, unknown> }).kv_transfer_params
    const d = await request(`${decodeUrl}/v1/completions`, { method: 'POST', dispatcher: agent, headers, body: JSON.stringify(decodeBody(body, params ?? undefined)) })
    return reply.code(d.statusCode).type('application/json').send(Buffer.from(await d.body.arrayBuffer()))
  })
  const url = await app.listen({ host: '127.0.0.1', port: 0 })
  const close = async (): Promise<void> => {
    await app.close()
    await agent.close()
    process.exit(0)
  }
  process.once('SIGTERM', () => void close())
  process.once('SIGINT', () => void close())
  announceReady('bare-proxy', url)
}
