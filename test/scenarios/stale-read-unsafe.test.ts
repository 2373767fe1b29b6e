import t from 'tap'
import { metric, REUSING_PREFILLER, startEngine, startRouterProcess, startUncheckedDecoder } from '../helpers/pd-agents.js'
import { LEASE_S, report, stallRun } from '../helpers/stall.js'
import { needNixl, probeNixl } from '../native/helpers.js'

/*
 * Issue #8, scenario a's negative control (stale-read.test.ts has the scenario): the same 10 s
 * stop of the decoder's agent under 5 s leases, with the deadline checks off (the test-only
 * switch): wrong text reaches clients, proof that the scenario can see the hazard it guards against.
 */

const probe = await probeNixl()

t.test('negative control: with the checks off the same stop produces wrong text', { skip: needNixl(t, probe) }, async (t) => {
  const prefill = await startEngine(t, { role: 'prefill', leaseSeconds: LEASE_S, simArgs: [...REUSING_PREFILLER] })
  const decode = await startUncheckedDecoder(t, LEASE_S)
  const router = await startRouterProcess(t, [prefill, decode])
  const run = await stallRun(router.url, [decode], 10_000, 'unsafe')
  const s = report(t, 'checks OFF, 10 s stop', run.outcomes)
  t.ok(s.wrong > 0, 'stale reads reached clients as wrong text: the test sees the hazard')
  t.equal(await metric(decode.agent.url, 'handoff_agent_kv_expired_total'), 0, 'nothing was declined')
})
