import t, { type Test } from 'tap'
import { probeNixl, needNixl } from '../native/helpers.js'
import { complete, completionBody, metric, sleep, startEngine, startRouterProcess, tally, type Engine, type Outcome } from '../helpers/pd-agents.js'

/*
 * Issue #8, scenario a: stale reads. P leases its blocks for 5 s; the decoders' agents are
 * stopped (SIGSTOP) while traffic goes on, so P's leases of the requests waiting on them run
 * out and P reuses those blocks (LIFO) for later prompts. When the agents continue, every
 * waiting pull reads blocks that may now hold another prompt's KV:
 * - with the deadline checks on: policy `fail` → a clear error, `recompute` → the oracle's
 *   text; never wrong text;
 * - a 2 s stop stays inside the lease: no failure at all;
 * - with the checks off (the test-only switch), wrong text reaches clients: proof that this
 *   test can see the hazard it guards against.
 */

const LEASE_S = 5
const probe = await probeNixl()

interface Run {
  stopMs: number
  decoders: Engine[]
  outcomes: Outcome[]
}

/** Traffic every `everyMs` for the whole run; the decoders' agents stopped from 1 s for `stopMs`. */
async function stallRun(url: string, decoders: Engine[], stopMs: number, tag: string): Promise<Run> {
  const everyMs = 150
  const totalMs = 1000 + stopMs + 1500
  const pending: Promise<Outcome>[] = []
  const started = performance.now()
  let stopped = false
  let continued = false
  for (let i = 0; performance.now() - started < totalMs; i++) {
    pending.push(complete(url, completionBody(i, tag), i, 90_000))
    const now = performance.now() - started
    if (!stopped && now >= 1000) {
      for (const d of decoders) d.agent.child.kill('SIGSTOP')
      stopped = true
    }
    if (stopped && !continued && now >= 1000 + stopMs) {
      for (const d of decoders) d.agent.child.kill('SIGCONT')
      continued = true
    }
    await sleep(everyMs)
  }
  if (!continued) for (const d of decoders) d.agent.child.kill('SIGCONT')
  return { stopMs, decoders, outcomes: await Promise.all(pending) }
}

function report(t: Test, name: string, outcomes: readonly Outcome[]): ReturnType<typeof tally> {
  const s = tally(outcomes)
  t.comment(`${name}: ${s.requests} requests, ${s.ok} oracle text, ${s.wrong} wrong text, ${s.failed} failed ${JSON.stringify(s.codes)}`)
  return s
}

t.test('stale reads: 10 s stop under 5 s leases', { skip: needNixl(t, probe) }, async (t) => {
  const prefill = await startEngine(t, { role: 'prefill', leaseSeconds: LEASE_S, simArgs: ['--num-blocks', '512'] })
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
  const prefill = await startEngine(t, { role: 'prefill', leaseSeconds: LEASE_S, simArgs: ['--num-blocks', '512'] })
  const decode = await startEngine(t, { role: 'decode', leaseSeconds: LEASE_S, simArgs: ['--kv-load-failure-policy', 'fail'] })
  const router = await startRouterProcess(t, [prefill, decode])
  const run = await stallRun(router.url, [decode], 2_000, 'control')
  const s = report(t, 'checks on, 2 s stop', run.outcomes)
  t.equal(s.wrong, 0, 'no wrong text')
  t.equal(s.failed, 0, 'no failure')
  t.ok((await metric(decode.agent.url, 'handoff_agent_pulls_total', { outcome: 'ok' })) >= s.requests, 'every answer came from a real READ')
})

t.test('negative control: with the checks off the same stop produces wrong text', { skip: needNixl(t, probe) }, async (t) => {
  const prefill = await startEngine(t, { role: 'prefill', leaseSeconds: LEASE_S, simArgs: ['--num-blocks', '512'] })
  const decode = await startEngine(t, {
    role: 'decode',
    leaseSeconds: LEASE_S,
    simArgs: ['--kv-load-failure-policy', 'fail'],
    agentArgs: ['--unsafe-skip-deadline-checks'],
    agentEnv: { HANDOFF_ALLOW_UNSAFE: '1' },
  })
  const router = await startRouterProcess(t, [prefill, decode])
  const run = await stallRun(router.url, [decode], 10_000, 'unsafe')
  const s = report(t, 'checks OFF, 10 s stop', run.outcomes)
  t.ok(s.wrong > 0, 'stale reads reached clients as wrong text: the test sees the hazard')
  t.equal(await metric(decode.agent.url, 'handoff_agent_kv_expired_total'), 0, 'nothing was declined')
})
