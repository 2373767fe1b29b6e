import t from 'tap'
import { request } from 'undici'
import { parseSimArgs } from '../../sim/src/config.js'
import { build, MODEL } from './build.js'

t.test('--api-key guards every /v1 path like vLLM; /health, /metrics and /sim stay open', async (t) => {
  const { app } = build(t, { apiKey: 'sekret' })
  const url = await app.listen({ host: '127.0.0.1', port: 0 })
  const call = async (method: 'GET' | 'POST', path: string, headers: Record<string, string> = {}, body?: object) => {
    const r = await request(`${url}${path}`, {
      method,
      headers: { ...headers, ...(body ? { 'content-type': 'application/json' } : {}) },
      body: body ? JSON.stringify(body) : null,
      headersTimeout: 10_000,
      bodyTimeout: 10_000,
    })
    const text = await r.body.text()
    return { status: r.statusCode, text }
  }
  const completion = { model: MODEL, prompt: 'guarded', max_tokens: 2 }
  for (const [method, path, body] of [
    ['GET', '/v1/models', undefined],
    ['POST', '/v1/completions', completion],
    ['POST', '/v1/chat/completions', { model: MODEL, messages: [{ role: 'user', content: 'x' }] }],
    ['GET', '/v1/nothing-here', undefined],
  ] as const) {
    for (const headers of [{}, { authorization: 'Bearer wrong' }, { authorization: 'sekret' }] as Record<string, string>[]) {
      const r = await call(method, path, headers, body)
      t.equal(r.status, 401, `${method} ${path} ${JSON.stringify(headers)}`)
      t.same(JSON.parse(r.text), { error: { message: 'Unauthorized', type: 'AuthenticationError', param: null, code: 'SIM_ERR_UNAUTHORIZED' } })
    }
  }
  const auth = { authorization: 'Bearer sekret' }
  t.equal((await call('GET', '/v1/models', auth)).status, 200)
  t.equal((await call('POST', '/v1/completions', auth, completion)).status, 200)
  t.equal((await call('GET', '/health')).status, 200, '/health is open')
  t.equal((await call('GET', '/metrics')).status, 200, '/metrics is open')
  t.equal((await call('GET', '/sim/info')).status, 200, '/sim/* is open')
  const log = JSON.parse((await call('GET', '/sim/requests')).text).requests as { path: string; headers: Record<string, string> }[]
  t.same(log.map((l) => l.path), ['/v1/models', '/v1/completions'], 'refused requests are not recorded')
  t.equal(log[1]?.headers.authorization, 'Bearer sekret', 'the log shows the key the router forwarded')
})

t.test('without --api-key nothing is guarded; the flag parses', async (t) => {
  const { app } = build(t)
  t.equal((await app.inject({ url: '/v1/models' })).statusCode, 200)
  t.match(parseSimArgs(['--api-key', 'k1']), { apiKey: 'k1' })
  t.throws(() => parseSimArgs(['--api-key', '']), { code: 'SIM_ERR_INVALID_CONFIG' })
})
