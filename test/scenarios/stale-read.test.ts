import t from 'tap'
import { probeNixl, needNixl } from '../native/helpers.js'
import { metric, REUSING_PREFILLER, startEngine, startRouterProcess } from '../helpers/pd-agents.js'
import { LEASE_S, report, stallRun } from '../helpers/stall.js'

/*
 * Issue #8, scenario a: stale reads. P leases its blocks for 5 s; the decoders' agents are
 * stopped (SIGSTOP) while traffic goes on, so P's leases of the requests waiting on them run
 * out and P reuses those blocks (LIFO) for later prompts. When the agents continue, every
 * waiting pull reads blocks that may now hold another prompt's KV:
 * - with the deadline checks on: policy `fail` → a clear error, `recompute` → the oracle's
 *   text; never wrong text;
 * - a 2 s stop stays inside the lease: no failure at all;
 * - with the checks off, wrong text reaches clients: stale-read-unsafe.test.ts.
 */

const probe = await probeNixl()

t.test('stale reads: 10 s stop under 5 s leases', { skip: needNixl(t, probe) }, async (t) => {
  const prefill = await startEngine(t, { role: 'prefill', leaseSeconds: LEASE_S, simArgs: [...REUSING_PREFILLER] })
  const fail = await startEngine(t, { role: 'decode', leaseSeconds: LEASE_S, simArgs: ['--kv-load-failure-policy', 'fail'] })
  const recompute = await startEngine(t, { role: 'decode', leaseSeconds: LEASE_S, simArgs: ['--kv-load-failure-policy', 'recompute'] })
  const router = await startRouterProcess(t, [prefill, fail, recompute])
  const run = await stallRun(router.url, [fail, recompute], 10_000, 'stale')

  const s = report(t, 'checks on, 10 s stop (fail + recompute decoders)', run.outcomes)
  t.equal(s.wrong, 0, 'no client got wrong text')
  t.ok(s.failed > 0, 'the stop made leases run out: the fail-policy decoder refused some reads')
  // D's 500 reaches the client as the router's 502, with D's code and message in it.
  const unclear = run.outcomes.filter((o) => o.status !== 200 && !/SIM_ERR_KV_LOAD_FAILED.*XFA_ERR_KV_EXPIRED/.test(o.message ?? ''))
  t.same(unclear.map((o) => `${o.code}: ${o.message}`), [], 'every failure names the KV load failure and the expired lease')
  const expiredFail = await metric(fail.agent.url, 'handoff_agent_kv_expired_total')
  const expiredRecompute = await metric(recompute.agent.url, 'handoff_agent_kv_expired_total')
  t.comment(`KV-expired pulls: fail decoder ${expiredFail}, recompute decoder ${expiredRecompute}`)
  t.ok(expiredRecompute > 0, 'the recompute decoder also found expired leases')
  const recomputed = await metric(recompute.sim.url, 'handoff_sim_kv_recomputed_requests_total')
  t.ok(recomputed >= expiredRecompute, `the recompute decoder recomputed (${recomputed}) instead of failing`)
  t.equal(s.failed, expiredFail, 'every failure is a refused stale read on the fail-policy decoder')
})

t.test('control: a 2 s stop stays inside the lease, nothing fails', { skip: needNixl(t, probe) }, async (t) => {
  const prefill = await startEngine(t, { role: 'prefill', leaseSeconds: LEASE_S, simArgs: [...REUSING_PREFILLER] })
  const decode = await startEngine(t, { role: 'decode', leaseSeconds: LEASE_S, simArgs: ['--kv-load-failure-policy', 'fail'] })
  const router = await startRouterProcess(t, [prefill, decode])
  const run = await stallRun(router.url, [decode], 2_000, 'control')
  const s = report(t, 'checks on, 2 s stop', run.outcomes)
  t.equal(s.wrong, 0, 'no wrong text')
  t.equal(s.failed, 0, 'no failure')
  t.ok((await metric(decode.agent.url, 'handoff_agent_pulls_total', { outcome: 'ok' })) >= s.requests, 'every answer came from a real READ')
})
