import t from 'tap'
import { isConnectFailure, mapUpstreamFailure, upstreamErrorDetail } from '../../router/src/proxy/upstream-errors.js'

function errWith(code: string, nested = false): Error {
  const e = Object.assign(new Error(code), { code })
  return nested ? Object.assign(new Error('fetch failed'), { code: 'UND_ERR_SOCKET', cause: e }) : e
}

t.test('transport failures map by cause: unreachable 503, slow 504, reset 502', async (t) => {
  const cases: [Error, string, number][] = [
    [errWith('ECONNREFUSED'), 'RTR_ERR_UPSTREAM_UNAVAILABLE', 503],
    [errWith('ENOTFOUND'), 'RTR_ERR_UPSTREAM_UNAVAILABLE', 503],
    [errWith('UND_ERR_CONNECT_TIMEOUT'), 'RTR_ERR_UPSTREAM_UNAVAILABLE', 503],
    [errWith('UND_ERR_HEADERS_TIMEOUT'), 'RTR_ERR_UPSTREAM_TIMEOUT', 504],
    [errWith('UND_ERR_BODY_TIMEOUT'), 'RTR_ERR_UPSTREAM_TIMEOUT', 504],
    [errWith('ECONNRESET'), 'RTR_ERR_UPSTREAM_RESET', 502],
    [errWith('UND_ERR_SOCKET'), 'RTR_ERR_UPSTREAM_RESET', 502],
    [errWith('ECONNREFUSED', true), 'RTR_ERR_UPSTREAM_UNAVAILABLE', 503],
  ]
  for (const [cause, code, status] of cases) {
    const e = mapUpstreamFailure({ kind: 'transport', cause }, 'prefill', 'p0')
    t.equal(e.code, code, `${(cause as { code?: string }).code}`)
    t.equal(e.statusCode, status)
    t.equal(e.cause, cause, 'the cause is chained')
    t.match(e.message, /prefill instance p0/)
  }
})

t.test('status and bad answers', async (t) => {
  const s = mapUpstreamFailure({ kind: 'status', status: 500, detail: 'boom' }, 'decode', 'd0')
  t.equal(s.code, 'RTR_ERR_UPSTREAM_STATUS')
  t.equal(s.statusCode, 502)
  t.match(s.message, /HTTP 500: boom/)
  const b = mapUpstreamFailure({ kind: 'bad-response', detail: 'not JSON' }, 'prefill', 'p0')
  t.equal(b.code, 'RTR_ERR_UPSTREAM_BAD_RESPONSE')
  t.notOk(isConnectFailure(b), 'a bad answer says nothing about health')
  t.notOk(isConnectFailure(s), "an engine's 5xx (a bad input) says nothing about health")
  t.ok(isConnectFailure(mapUpstreamFailure({ kind: 'transport', cause: Object.assign(new Error('x'), { code: 'ECONNREFUSED' }) }, 'decode', 'd0')))
  t.notOk(isConnectFailure(mapUpstreamFailure({ kind: 'transport', cause: Object.assign(new Error('x'), { code: 'UND_ERR_HEADERS_TIMEOUT' }) }, 'decode', 'd0')), 'a slow answer is not a failure of the instance')
})

t.test('engine error bodies give their message', async (t) => {
  t.equal(upstreamErrorDetail('{"error":{"message":"too long"}}'), 'too long')
  t.equal(upstreamErrorDetail('{"message":"flat"}'), 'flat')
  t.equal(upstreamErrorDetail('{"error":{"message":"KV load failed","code":"SIM_ERR_KV_LOAD_FAILED"}}'), 'SIM_ERR_KV_LOAD_FAILED: KV load failed', 'a string code is kept')
  t.equal(upstreamErrorDetail('{"error":{"message":"bad","code":400}}'), 'bad', "vLLM's numeric code is the status: dropped")
  t.equal(upstreamErrorDetail('plain text'), 'plain text')
  t.equal(upstreamErrorDetail(''), '(empty body)')
})
