import t from 'tap'
import { get, post, simRequests, startRouter, startSim } from '../helpers/cluster.js'

const ADMIN = 'admin-token-123'

t.test('a pair whose KV loads keep failing rests; its engines keep serving other pairs', async (t) => {
  const p = await startSim(t, ['--role', 'prefill'])
  // d0 answers every completion with a 500 (as vLLM does for a failed KV load under
  // kv_load_failure_policy=fail); its /health stays fine, so only the pair can tell.
  const d0 = await startSim(t, ['--role', 'decode', '--error-rate', '1'])
  const d1 = await startSim(t, ['--role', 'decode'])
  const { url } = await startRouter(
    t,
    [
      { id: 'p0', role: 'prefill', url: p.url },
      { id: 'd0', role: 'decode', url: d0.url },
      { id: 'd1', role: 'decode', url: d1.url },
    ],
    { adminToken: ADMIN, pairBreaker: { failureThreshold: 2, openMs: 60_000, maxOpenMs: 120_000 } },
  )
  const statuses: number[] = []
  for (let i = 0; i < 24; i++) statuses.push((await post(`${url}/v1/completions`, { model: 'handoff/sim-1', prompt: `breaker ${i}`, max_tokens: 2 })).status)
  const toD0 = (await simRequests(d0)).filter((r) => r.path === '/v1/completions').length
  t.equal(toD0, 2, 'd0 got exactly the two decode legs that opened the breaker')
  t.equal(statuses.filter((s) => s !== 200).length, 2, 'only those two failed')
  const topo = (await get(`${url}/topology`, { authorization: `Bearer ${ADMIN}` })).json<{ pairing: { resting: { prefill: string; decode: string; state: string }[] } }>()
  t.match(topo.pairing.resting, [{ prefill: 'p0', decode: 'd0', state: 'open' }])
  t.match((await get(`${url}/metrics`)).text, /handoff_router_pair_breaker_opens_total 1/)
  const ready = (await get(`${url}/ready`)).json<{ instances: { id: string; healthy: boolean }[] }>()
  t.ok(ready.instances.every((i) => i.healthy), 'no engine was marked unhealthy')
})
