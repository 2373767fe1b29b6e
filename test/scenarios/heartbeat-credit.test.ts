import t from 'tap'
import { needNixl, probeNixl } from '../native/helpers.js'
import { complete, completionBody, metric, startEngine, startRouterProcess, tally } from '../helpers/pd-agents.js'

/*
 * Issue 17 item 4, the end-to-end case the design promises: a healthy request that a busy
 * decoder holds past P's original expiry (8 s leases; D queues the request 10.5 s before its
 * READ) is kept alive by D's heartbeats and is NOT failed. The decoder tells its agent about
 * the pull as soon as the request reaches it (and again every lease/6 while it waits, as
 * vLLM's scheduler heartbeats a waiting request), so the heartbeat chain starts then. The
 * control: a decoder that does not say so gets no credit for its wait, and the READ is
 * refused as KV-expired (never wrong text).
 */

const probe = await probeNixl()
// Not the 5 s other scenarios use. D credits a chain only while every gap between heartbeats
// stays under the extension bound less the margin (deadline.ts), and the bound shrinks with
// the time from P's finish to D's first heartbeat: the router's hop, D taking the request,
// the first handshake. At 5 s that time had to stay under about 0.8 s with heartbeats every
// lease/6, and on a loaded 2-core CI machine one request in three sometimes missed it; at 8 s
// it may take about 2 s. A production lease (30 s by default) allows about 14 s.
const LEASE_S = 8

for (const announce of [true, false]) {
  t.test(`a decoder queued past P's expiry ${announce ? 'that tells its agent: heartbeats carry it' : 'that says nothing: KV-expired, never wrong text'}`, { skip: needNixl(t, probe) }, async (t) => {
    const prefill = await startEngine(t, { role: 'prefill', leaseSeconds: LEASE_S })
    const decode = await startEngine(t, {
      role: 'decode',
      leaseSeconds: LEASE_S,
      simArgs: ['--kv-load-failure-policy', 'fail', '--decode-queue-ms', '10500', ...(announce ? [] : ['--skip-pull-expectations'])],
    })
    // The agents check every read themselves (and do not register with this router).
    const router = await startRouterProcess(t, [prefill, decode], { leases: { leaseSeconds: LEASE_S, readCheck: 'engine' } })
    const outcomes = await Promise.all([0, 1, 2].map((i) => complete(router.url, completionBody(i, announce ? 'credit' : 'nocredit'), i, 60_000)))
    const s = tally(outcomes)
    t.comment(`wrong text: ${s.wrong} of ${s.requests} (${s.ok} oracle text, ${s.failed} failed ${JSON.stringify(s.codes)}); waited ${outcomes.map((o) => Math.round(o.ms)).join(', ')} ms`)
    // Why a READ was refused (heartbeat_gap, late_first_heartbeat, ...), where one was.
    for (const o of outcomes) if (o.message !== undefined) t.comment(`request ${o.i}: ${o.message}`)
    t.equal(s.wrong, 0, 'no wrong text')
    t.ok(outcomes.every((o) => o.ms > LEASE_S * 1000), "every request outlived P's original lease")
    const expired = await metric(decode.agent.url, 'handoff_agent_kv_expired_total')
    if (announce) {
      t.equal(s.ok, 3, 'every request succeeded with its own KV')
      t.equal(expired, 0, 'no READ was refused')
      t.equal(await metric(decode.agent.url, 'handoff_agent_pulls_total', { outcome: 'ok' }), 3, 'every answer came from a real READ')
      t.ok((await metric(prefill.agent.url, 'handoff_agent_heartbeats_received_total', { result: 'extended' })) >= 3, "P extended the leases on D's heartbeats")
    } else {
      t.equal(s.failed, 3, 'without credit every READ past the lease is refused')
      t.equal(expired, 3, 'as KV-expired')
      t.ok(outcomes.every((o) => /XFA_ERR_KV_EXPIRED/.test(o.message ?? '')), 'and the client is told so')
    }
  })
}
