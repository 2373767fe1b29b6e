import t from 'tap'
import { request } from 'undici'
import { ManualClock } from '../../common/clock.js'
import { build, MODEL } from './build.js'

async function until(cond: () => boolean, what: string): Promise<void> {
  const deadline = Date.now() + 10_000
  while (!cond()) {
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`)
    await new Promise((r) => setTimeout(r, 5))
  }
}

t.test('an X-Request-Id already in flight is refused with 400; the id is free again once it ends', async (t) => {
  const clock = new ManualClock()
  const { app } = build(t, { prefillDelayMs: 1000 }, { clock })
  const body = { model: MODEL, prompt: 'hold me', max_tokens: 2 }
  const send = (id: string | undefined, extra: object = {}) =>
    app.inject({ method: 'POST', url: '/v1/completions', headers: id ? { 'x-request-id': id } : {}, payload: { ...body, ...extra } })

  const first = send('dup-1')
  await until(() => clock.pendingTimers > 0, 'the first request to start prefilling')
  const dup = await send('dup-1')
  t.equal(dup.statusCode, 400)
  t.match(dup.json(), { error: { code: 'SIM_ERR_DUPLICATE_REQUEST_ID', type: 'BadRequestError', message: /dup-1/ } })
  const dupChat = await app.inject({ method: 'POST', url: '/v1/chat/completions', headers: { 'x-request-id': 'dup-1' }, payload: { model: MODEL, messages: [{ role: 'user', content: 'x' }] } })
  t.equal(dupChat.statusCode, 400, 'the id is the header value, whatever the endpoint')

  const other = send('dup-2')
  const anonymous = send(undefined)
  await until(() => clock.pendingTimers >= 3, 'the other requests to start')
  clock.advance(1000)
  t.equal((await first).statusCode, 200)
  t.equal((await other).statusCode, 200)
  t.equal((await anonymous).statusCode, 200)
  t.equal((await (async () => {
    const again = send('dup-1')
    await until(() => clock.pendingTimers > 0, 'the reused id to start')
    clock.advance(1000)
    return again
  })()).statusCode, 200, 'reusable once the first request ended')

  // A request that fails after it was admitted frees its id too.
  const failing = await app.inject({ method: 'POST', url: '/v1/completions', headers: { 'x-request-id': 'dup-3' }, payload: { ...body, kv_transfer_params: { do_remote_prefill: true, remote_num_tokens: 999 } } })
  t.equal(failing.json().error.code, 'SIM_ERR_NUM_TOKENS_MISMATCH')
  const retry = send('dup-3')
  await until(() => clock.pendingTimers > 0, 'the retry to start')
  clock.advance(1000)
  t.equal((await retry).statusCode, 200)

  const log = (await app.inject({ url: '/sim/requests' })).json().requests as { xRequestId: string | null }[]
  t.same(log.map((l) => l.xRequestId).slice(0, 6), ['dup-1', 'dup-1', 'dup-1', 'dup-2', null, 'dup-1'], 'the log shows the ids sent')
})

t.test('over a socket: a stream holds its id until it ends or the client leaves', async (t) => {
  const { app } = build(t, { decodeDelayMs: 200 })
  const url = await app.listen({ host: '127.0.0.1', port: 0 })
  const body = JSON.stringify({ model: MODEL, prompt: 'a slow stream', max_tokens: 20, stream: true })
  const post = (signal?: AbortSignal) =>
    request(`${url}/v1/completions`, { method: 'POST', headers: { 'content-type': 'application/json', 'x-request-id': 'sock-1' }, body, signal: signal ?? null, headersTimeout: 10_000, bodyTimeout: 10_000 })
  const ac = new AbortController()
  const streaming = await post(ac.signal)
  t.equal(streaming.statusCode, 200)
  const second = await post()
  t.equal(second.statusCode, 400)
  t.match(await second.body.json(), { error: { code: 'SIM_ERR_DUPLICATE_REQUEST_ID' } })
  ac.abort()
  await streaming.body.text().catch(() => {})
  // The server sees the close asynchronously; poll until the id is free.
  const deadline = Date.now() + 10_000
  for (;;) {
    const r = await request(`${url}/v1/completions`, {
      method: 'POST',
      headers: { 'content-type': 'application/json', 'x-request-id': 'sock-1' },
      body: JSON.stringify({ model: MODEL, prompt: 'short', max_tokens: 1 }),
      headersTimeout: 10_000,
      bodyTimeout: 10_000,
    })
    await r.body.text()
    if (r.statusCode === 200) break
    t.equal(r.statusCode, 400)
    if (Date.now() > deadline) throw new Error('the id was never released')
    await new Promise((res) => setTimeout(res, 50))
  }
  t.pass('released after the client left')
})
