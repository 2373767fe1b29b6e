import t from 'tap'
import type { Test } from 'tap'
import { setTimeout as sleep } from 'node:timers/promises'
import { request } from 'undici'
import { post, startRouter, startSim } from '../helpers/cluster.js'

/*
 * Issue 37 item 2: in a mixed fleet (leases.readCheck auto, agentToken set) the read check is
 * the reading decoder's. A decode leg whose first decoder refuses the connection goes to
 * another; the check (and whether the leg is streamed and assembled) must be decided again
 * for that one. Here the first decoder is a dead port kept in routing, the other a real
 * simulator frozen (SIGSTOP) 2.5 s across the router's 1.5 s read window. Agents are
 * registered by hand with an open event stream, as a transfer agent or none at all.
 */
const MODEL = 'handoff/sim-1'
const AGENT = 'agent-token-redirect-0'
const body = { model: MODEL, prompt: 'the quick brown fox jumps over the lazy dog', max_tokens: 4 }

/** A registered agent whose event stream stays open until the test ends (the router trusts only such). */
async function agentFor(t: Test, url: string, instance: { id: string; url: string }): Promise<void> {
  const auth = { authorization: `Bearer ${AGENT}` }
  const agentId = `${instance.id}-agent`
  const reg = await post(`${url}/v1/agents`, { agentId, engineId: `${instance.id}-engine`, role: 'decode', agentUrl: 'http://127.0.0.1:7999', engineUrl: instance.url, kind: 'transfer-agent' }, auth)
  t.equal(reg.status, 200, `${agentId} registered`, { body: reg.text })
  const ac = new AbortController()
  const res = await request(`${url}/v1/agents/${agentId}/events`, { headers: auth, signal: ac.signal })
  res.body.on('error', () => {}).resume()
  t.teardown(() => ac.abort())
}

/**
 * p0, the dead decoder `dead` (a closed port, kept in routing: no probes, no ejection) and a
 * live one; the agent-backed one is `trusted`. Six requests at once while the live decoder is
 * frozen: about half of them try the dead one first and are redirected.
 */
async function run(t: Test, trusted: 'dead' | 'live'): Promise<{ statuses: number[]; codes: (string | undefined)[]; live: string }> {
  const p = await startSim(t, ['--role', 'prefill'])
  const live = await startSim(t, ['--role', 'decode'])
  const gone = await startSim(t, ['--role', 'decode'])
  const deadUrl = gone.url
  await gone.stop()
  const instances = [
    { id: 'p0', role: 'prefill' as const, url: p.url },
    { id: 'dead', role: 'decode' as const, url: deadUrl },
    { id: 'live', role: 'decode' as const, url: live.url },
  ]
  const { url } = await startRouter(t, instances, {
    probe: false,
    agentToken: AGENT,
    leases: { leaseSeconds: 2, marginMs: 500, readCheck: 'auto' },
    health: { unhealthyThreshold: 1000 },
  })
  await agentFor(t, url, instances.find((i) => i.id === trusted)!)
  live.child.kill('SIGSTOP')
  const answers = Array.from({ length: 6 }, () => post(`${url}/v1/completions`, body))
  await sleep(2500)
  live.child.kill('SIGCONT')
  const done = await Promise.all(answers)
  const metrics = await (await fetch(`${url}/metrics`)).text()
  const refused = Number(/^handoff_router_upstream_errors_total\{leg="decode",code="RTR_ERR_UPSTREAM_UNAVAILABLE"\} (\d+)/m.exec(metrics)?.[1] ?? 0)
  t.ok(refused > 0, `some requests tried the dead decoder first and were redirected (${refused})`)
  return { statuses: done.map((a) => a.status), codes: done.map((a) => a.json<{ error?: { code?: string } }>().error?.code), live: live.url }
}

t.test('a stock decoder behind an agent-backed one is checked: its late reads are withheld', async (t) => {
  const { statuses, codes } = await run(t, 'dead')
  t.same(statuses, [503, 503, 503, 503, 503, 503], 'no late answer passed as 200')
  t.same(new Set(codes), new Set(['RTR_ERR_LATE_READ']), 'each withheld as a late read')
})

t.test('an agent-backed decoder behind a stock one checks its own reads: its answers pass', async (t) => {
  const { statuses } = await run(t, 'live')
  t.same(statuses, [200, 200, 200, 200, 200, 200], 'every answer passed: the agent checked the read')
})
