import { Writable } from 'node:stream'
import pino from 'pino'
import t from 'tap'
import type { TransferAgent } from '../../transfer-agent/src/agent.js'
import { buildAgentApp } from '../../transfer-agent/src/app.js'
import { createAgentMetrics } from '../../transfer-agent/src/metrics.js'
import { loggerOptions } from '../../common/logger.js'
import { get, post, startRouter } from '../helpers/cluster.js'

// Issue 18 item 4: request URLs were logged with their query strings, where clients put
// keys and tokens (`?api_key=…`). The path is logged, the query only as `?[redacted]`.
const SECRET = 'sk-secret-in-the-query'

t.test('router: request logs carry the path, never the query string', async (t) => {
  const { url, logs } = await startRouter(t, [{ id: 'b', role: 'both', url: 'http://127.0.0.1:9' }], { probe: false, apiKeys: ['key-12345678'] })
  await get(`${url}/v1/models?api_key=${SECRET}`)
  await get(`${url}/health?token=${SECRET}`)
  await get(`${url}/nope?secret=${SECRET}`)
  await post(`${url}/v1/completions?key=${SECRET}`, { model: 'm', prompt: 'x' }, { authorization: 'Bearer key-12345678' })
  await get(`${url}/ready`)
  const text = logs.map((l) => JSON.stringify(l)).join('\n')
  t.notMatch(text, SECRET, 'the secret is in no log line')
  const urls = logs.filter((l) => l.msg === 'incoming request').map((l) => (l.req as { url: string }).url)
  t.same(urls, ['/v1/models?[redacted]', '/health?[redacted]', '/nope?[redacted]', '/v1/completions?[redacted]', '/ready'])
})

t.test('agent: no log line carries a query string', async (t) => {
  const lines: string[] = []
  const sink = new Writable({
    write(chunk: Buffer, _enc, cb) {
      lines.push(chunk.toString('utf8'))
      cb()
    },
  })
  const agent = new Proxy({} as TransferAgent, {
    get: (_t, prop) => (prop === 'then' ? undefined : prop === 'close' ? async () => {} : async () => Promise.reject(new Error('boom'))),
  })
  const app = buildAgentApp({ agent, metrics: createAgentMetrics(), logger: pino({ level: 'trace' }, sink) })
  const url = await app.listen({ host: '127.0.0.1', port: 0 })
  t.teardown(() => app.close())
  const notFound = await get(`${url}/nope?token=${SECRET}`)
  t.notMatch(notFound.text, SECRET, 'nor the 404 answer')
  await get(`${url}/v1/status?token=${SECRET}`)
  await post(`${url}/v1/peers/gone?token=${SECRET}`, { engineIds: ['e'] })
  t.ok(lines.length > 0, 'the failures were logged')
  t.notMatch(lines.join(''), SECRET)
})

t.test("the processes' own loggers (loggerOptions) serialize req the same way", async (t) => {
  const lines: string[] = []
  const sink = new Writable({
    write(chunk: Buffer, _enc, cb) {
      lines.push(chunk.toString('utf8'))
      cb()
    },
  })
  pino(loggerOptions({ name: 'router' }), sink).info({ req: { method: 'GET', url: `/v1/models?key=${SECRET}`, headers: {} } }, 'incoming request')
  t.match(JSON.parse(lines[0] ?? '{}'), { req: { method: 'GET', url: '/v1/models?[redacted]' } })
})
