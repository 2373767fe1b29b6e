import pino from 'pino'
import t from 'tap'
import { createAgentMetrics } from '../../transfer-agent/src/metrics.js'
import { buildAgentApp } from '../../transfer-agent/src/app.js'
import type { TransferAgent } from '../../transfer-agent/src/agent.js'
import { post, startRouter } from '../helpers/cluster.js'

// Issue 18 item 4: a body nested 200k deep overflowed the stack while being parsed (500
// "Maximum call stack size exceeded"); it is a client's mistake, answered 400 with a code.
const N = 200_000
const bodies = {
  'unterminated arrays': '['.repeat(N),
  'closed arrays': '['.repeat(N) + ']'.repeat(N),
  'nested objects': '{"a":'.repeat(N) + '1' + '}'.repeat(N),
  'a deep field': `{"model":"m","prompt":"x","vllm_xargs":${'['.repeat(N)}${']'.repeat(N)}}`,
}

t.test('router: a deeply nested body is 400 RTR_ERR_INVALID_JSON', async (t) => {
  const { url, logs } = await startRouter(t, [{ id: 'b', role: 'both', url: 'http://127.0.0.1:9' }], { probe: false })
  for (const [what, body] of Object.entries(bodies)) {
    for (const path of ['/v1/completions', '/v1/chat/completions']) {
      const res = await post(`${url}${path}`, body)
      t.equal(res.status, 400, `${path}, ${what}: ${res.text.slice(0, 120)}`)
      t.equal(res.json<{ error: { code: string } }>().error.code, 'RTR_ERR_INVALID_JSON', `${path}, ${what}`)
    }
  }
  t.same(logs.filter((l) => (l.level as number) >= 50), [], 'nothing logged as a server error')
  const deepButAllowed = `{"model":"m","prompt":"x","vllm_xargs":{"a":${'['.repeat(500)}${']'.repeat(500)}}}`
  const ok = await post(`${url}/v1/completions`, deepButAllowed)
  t.not(ok.status, 400, `a body 502 deep is parsed and sent on (${ok.status}: no instance answers)`)
})

t.test('agent: a deeply nested body is 400 XFA_ERR_INVALID_ARG', async (t) => {
  const agent = new Proxy({} as TransferAgent, { get: (_t, prop) => (prop === 'then' ? undefined : async () => ({})) })
  const app = buildAgentApp({ agent, metrics: createAgentMetrics(), logger: pino({ level: 'silent' }) })
  const url = await app.listen({ host: '127.0.0.1', port: 0 })
  t.teardown(() => app.close())
  for (const [what, body] of Object.entries(bodies)) {
    for (const path of ['/v1/pulls', '/v1/leases', '/v1/engine/attach', '/v1/peers/gone']) {
      const res = await post(`${url}${path}`, body)
      t.equal(res.status, 400, `${path}, ${what}: ${res.text.slice(0, 120)}`)
      t.equal(res.json<{ error: { code: string } }>().error.code, 'XFA_ERR_INVALID_ARG', `${path}, ${what}`)
    }
  }
})
