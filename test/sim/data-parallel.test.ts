import t from 'tap'
import { ManualClock } from '../../common/clock.js'
import { parseSimArgs } from '../../sim/src/config.js'
import { oracleText } from '../../sim/src/oracle.js'
import { FakeKv } from './fake-kv.js'
import { build, MODEL } from './build.js'

/*
 * vLLM data parallel in the simulator (issue 37 item 3): `--data-parallel-size N` serves N
 * ranks behind one port, each its own engine named `<engine_id>_dp<rank>` with its side
 * channel at the base port + rank (vLLM 0.32: v1/engine/core.py run_engine_core,
 * nixl/base_scheduler.py); `--data-parallel-rank R` is one rank of an externally balanced
 * deployment, the only DP shape with `--kv agent` (one transfer agent per rank).
 */

const prefill = { model: MODEL, prompt: 'data parallel', max_tokens: 3, kv_transfer_params: { do_remote_decode: true } }

t.test('--data-parallel-size 2: answers alternate between the ranks, each under its own engine_id and side channel port', async (t) => {
  const { app } = build(t, { role: 'prefill', engineId: 'base', dataParallelSize: 2, sideChannelPort: 5600 })
  const seen: [string, number][] = []
  for (let i = 0; i < 4; i++) {
    const r = await app.inject({ method: 'POST', url: '/v1/completions', payload: prefill })
    t.equal(r.statusCode, 200)
    t.equal(r.json().choices[0].text, oracleText({ kind: 'completion', prompt: 'data parallel', maxTokens: 3 }), 'every rank gives the oracle text')
    const p = r.json().kv_transfer_params
    seen.push([p.remote_engine_id, p.remote_port])
  }
  t.same(seen, [['base_dp0', 5600], ['base_dp1', 5601], ['base_dp0', 5600], ['base_dp1', 5601]], 'round robin, remote_port = base + rank')
  t.match((await app.inject({ url: '/sim/info' })).json(), { engineId: 'base_dp0', engineIds: ['base_dp0', 'base_dp1'] })
})

t.test("vLLM's X-data-parallel-rank picks the rank; one out of range is 400, one that is not an integer is ignored", async (t) => {
  const { app } = build(t, { role: 'prefill', engineId: 'base', dataParallelSize: 3 })
  const ask = (rank: string) => app.inject({ method: 'POST', url: '/v1/completions', headers: { 'x-data-parallel-rank': rank }, payload: prefill })
  for (const rank of ['2', '2', '1']) t.equal((await ask(rank)).json().kv_transfer_params.remote_engine_id, `base_dp${rank}`)
  const out = await ask('3')
  t.equal(out.statusCode, 400)
  t.match(out.json().error, { code: 'SIM_ERR_BAD_REQUEST', message: /data_parallel_rank 3 is out of range \[0, 3\)/ })
  t.equal((await ask('-1')).statusCode, 400)
  t.equal((await ask('two')).json().kv_transfer_params.remote_engine_id, 'base_dp0', 'ignored: the next rank in turn')
})

t.test('one engine keeps its engine_id; a single rank of several (external balancing) is suffixed', async (t) => {
  const one = build(t, { role: 'prefill', engineId: 'solo' })
  t.equal((await one.app.inject({ method: 'POST', url: '/v1/completions', payload: prefill })).json().kv_transfer_params.remote_engine_id, 'solo')
  const rank = build(t, { role: 'prefill', engineId: 'ext', dataParallelSize: 4, dataParallelRank: 3, sideChannelPort: 5600 })
  const p = (await rank.app.inject({ method: 'POST', url: '/v1/completions', payload: prefill })).json().kv_transfer_params
  t.same([p.remote_engine_id, p.remote_port], ['ext_dp3', 5603])
  t.same((await rank.app.inject({ url: '/sim/info' })).json().engineIds, ['ext_dp3'])
})

t.test('--kv agent: one rank per process, which its agent attaches under the suffixed engine_id', async (t) => {
  t.throws(() => parseSimArgs(['--kv', 'agent', '--agent-url', 'http://127.0.0.1:7300', '--data-parallel-size', '2']), { code: 'SIM_ERR_INVALID_CONFIG', message: /--kv none only/ })
  t.throws(() => parseSimArgs(['--data-parallel-size', '2', '--data-parallel-rank', '2']), { code: 'SIM_ERR_INVALID_CONFIG', message: /must be below --data-parallel-size/ })
  t.match(parseSimArgs(['--kv', 'agent', '--agent-url', 'http://127.0.0.1:7300', '--data-parallel-size', '2', '--data-parallel-rank', '1']), { dataParallelSize: 2, dataParallelRank: 1 })
  const kv = new FakeKv({ clock: new ManualClock() })
  const { app } = build(t, { role: 'prefill', kv: 'agent', agentUrl: 'http://127.0.0.1:1', engineId: 'ag', dataParallelSize: 2, dataParallelRank: 1 }, { kvTransport: kv.transport() })
  const r = await app.inject({ method: 'POST', url: '/v1/completions', payload: prefill })
  t.equal(r.statusCode, 200)
  t.equal(r.json().kv_transfer_params.remote_engine_id, 'ag_dp1')
})
