import { once } from 'node:events'
import { request } from 'undici'
import t from 'tap'
import { spawnService } from '../../common/spawn.js'
import { oracleForBody } from '../../sim/src/oracle.js'
import { get, post, simRequests, startRouter, startSim, streamedText, waitFor } from '../helpers/cluster.js'

t.test('SIGTERM: in-flight streams finish, new requests are refused, then the router exits', async (t) => {
  const d = await startSim(t, ['--role', 'both', '--decode-delay-ms', '60'])
  const router = await spawnService({
    args: ['router', '--port', '0', '--log-level', 'warn'],
    env: { ...process.env, HANDOFF_INSTANCES: JSON.stringify([{ id: 'b0', role: 'both', url: d.url }]) },
  })
  t.teardown(() => router.stop(1000))
  const body = { model: 'handoff/sim-1', prompt: 'graceful shutdown', max_tokens: 20, stream: true }
  const res = await request(`${router.url}/v1/completions`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify(body) })
  t.equal(res.statusCode, 200)
  const chunks: string[] = []
  const reading = (async () => {
    for await (const c of res.body) chunks.push(c.toString())
  })()
  await waitFor(() => chunks.length > 0, 3000)
  const exited = once(router.child, 'exit') as Promise<[number | null]>
  router.child.kill('SIGTERM')
  // A new connection is refused (the listener closed) or answered 503 while draining.
  await new Promise((r) => setTimeout(r, 100))
  const late = await post(`${router.url}/v1/completions`, { ...body, stream: false }).catch((err: Error) => err)
  if (late instanceof Error) t.match((late as { code?: string }).code ?? late.message, /ECONNREFUSED|ECONNRESET|UND_ERR/)
  else t.equal(late.status, 503)
  await reading
  t.equal(streamedText(chunks.join('')), oracleForBody('/v1/completions', body), 'the in-flight stream completed')
  const [code] = await exited
  t.equal(code, 0)
})

t.test('API keys guard the /v1 routes but not health', async (t) => {
  const b = await startSim(t, ['--role', 'both'])
  const { url } = await startRouter(t, [{ id: 'b0', role: 'both', url: b.url }], { apiKeys: ['secret-key-123'] })
  const body = { model: 'handoff/sim-1', prompt: 'keys', max_tokens: 3 }
  const none = await post(`${url}/v1/completions`, body)
  t.equal(none.status, 401)
  t.equal(none.json<{ error: { code: string; type: string } }>().error.code, 'RTR_ERR_UNAUTHORIZED')
  t.equal((await post(`${url}/v1/completions`, body, { authorization: 'Bearer wrong-key-000' })).status, 401)
  t.equal((await get(`${url}/v1/models`)).status, 401)
  const ok = await post(`${url}/v1/completions`, body, { authorization: 'Bearer secret-key-123' })
  t.equal(ok.status, 200)
  t.equal(ok.json<{ choices: { text: string }[] }>().choices[0]?.text, oracleForBody('/v1/completions', body), 'a both instance serves in one leg')
  t.equal((await get(`${url}/health`)).status, 200)
})

t.test('the router sends the upstream API key on both legs', async (t) => {
  const p = await startSim(t, ['--role', 'prefill'])
  const d = await startSim(t, ['--role', 'decode'])
  const { url } = await startRouter(
    t,
    [
      { id: 'p0', role: 'prefill', url: p.url },
      { id: 'd0', role: 'decode', url: d.url },
    ],
    { upstreamApiKey: 'engine-key' },
  )
  const res = await post(`${url}/v1/completions`, { model: 'handoff/sim-1', prompt: 'x', max_tokens: 2 })
  t.equal(res.status, 200)
  for (const sim of [p, d]) {
    const r = (await simRequests(sim)).find((x) => x.path === '/v1/completions')
    t.equal(r?.headers.authorization, 'Bearer engine-key')
  }
})
