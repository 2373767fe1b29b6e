import t from 'tap'
import { setTimeout as sleep } from 'node:timers/promises'
import { post, sseEvents, startRouter, startSim, streamedText } from '../helpers/cluster.js'

/*
 * leases.readCheck (issue 19): stock vLLM in pull mode reads P's blocks whenever it gets to
 * them, also after P's lease ran out and P reused them (seen with vLLM 0.32: a decoder
 * SIGSTOPped past kv_lease_duration answered 200 with another prompt's text). Where the
 * router checks reads, D's answer reaches the client only if its first token came before
 * the lease's expiry minus the margin; a non-streamed request's decode leg is streamed from D
 * for that, and assembled. Here a real decoder process is frozen (SIGSTOP) across the
 * router's 2 s lease before its first token, then thawed.
 */
const MODEL = 'handoff/sim-1'
const ADMIN = 'admin-token-read-check'

async function cluster(t: Parameters<typeof startSim>[0], readCheck: 'router' | 'engine' | 'auto', agentToken?: string) {
  const p = await startSim(t, ['--role', 'prefill'])
  const d = await startSim(t, ['--role', 'decode'])
  const { url } = await startRouter(
    t,
    [
      { id: 'p0', role: 'prefill', url: p.url },
      { id: 'd0', role: 'decode', url: d.url },
    ],
    { probe: false, adminToken: ADMIN, leases: { leaseSeconds: 2, marginMs: 500, readCheck }, ...(agentToken ? { agentToken } : {}) },
  )
  return { url, d }
}

/** Sends `body` while D is frozen for `ms`: its first token comes that late at least. */
async function withFrozenDecoder(d: Awaited<ReturnType<typeof startSim>>, ms: number, send: () => ReturnType<typeof post>): ReturnType<typeof post> {
  d.child.kill('SIGSTOP')
  const answer = send()
  await sleep(ms)
  d.child.kill('SIGCONT')
  return answer
}

async function lateReads(url: string): Promise<number> {
  const res = await fetch(`${url}/metrics`)
  return Number(/^handoff_router_late_reads_total (\d+)/m.exec(await res.text())?.[1] ?? NaN)
}

const body = { model: MODEL, prompt: 'the quick brown fox jumps over the lazy dog', max_tokens: 4 }

t.test('readCheck router: a first token past the lease is withheld, streamed or not', async (t) => {
  const { url, d } = await cluster(t, 'router')
  const plain = await withFrozenDecoder(d, 2500, () => post(`${url}/v1/completions`, body))
  t.equal(plain.status, 503, 'a non-streamed request: 503', { body: plain.text })
  t.match(plain.json(), { error: { code: 'RTR_ERR_LATE_READ' } })
  const streamed = await withFrozenDecoder(d, 2500, () => post(`${url}/v1/completions`, { ...body, stream: true }))
  t.equal(streamed.status, 200, 'a stream’s head was sent before D’s first token')
  const events = sseEvents(streamed.text)
  t.match(events, [{ error: { code: 'RTR_ERR_LATE_READ' } }, '[DONE]'], 'then only the coded error event: no token of the late read')
  t.equal(await lateReads(url), 2, 'both counted')
  // In time, the same cluster answers as always.
  const fine = await post(`${url}/v1/completions`, body)
  t.equal(fine.status, 200)
  t.equal(fine.json<{ object: string }>().object, 'text_completion')
})

t.test('readCheck engine (the control): the same late answer is passed on', async (t) => {
  const { url, d } = await cluster(t, 'engine')
  const plain = await withFrozenDecoder(d, 2500, () => post(`${url}/v1/completions`, body))
  t.equal(plain.status, 200, 'D checks its own reads here: the router trusts its answer', { body: plain.text })
  t.equal(await lateReads(url), 0)
})

t.test('readCheck auto without agentToken: every decoder’s reads are checked', async (t) => {
  const { url, d } = await cluster(t, 'auto')
  const plain = await withFrozenDecoder(d, 2500, () => post(`${url}/v1/completions`, body))
  t.match(plain.json(), { error: { code: 'RTR_ERR_LATE_READ' } }, { body: plain.text })
})

t.test('readCheck auto with agentToken: a transfer agent’s decoder is trusted, a vLLM connector’s is checked', async (t) => {
  const AGENT = 'agent-token-read-check'
  const { url, d } = await cluster(t, 'auto', AGENT)
  const register = (kind: 'transfer-agent' | 'vllm-connector') =>
    post(`${url}/v1/agents`, { agentId: 'd0-agent', engineId: 'd0-engine', role: 'decode', agentUrl: 'http://127.0.0.1:7999', engineUrl: d.url, kind }, { authorization: `Bearer ${AGENT}` })
  // handoff's vLLM connector acts on events but checks no read against P's lease (vLLM 0.32
  // does not in pull mode): its decoder stays under the router's check.
  t.equal((await register('vllm-connector')).status, 200)
  const connector = await withFrozenDecoder(d, 2500, () => post(`${url}/v1/completions`, body))
  t.match(connector.json(), { error: { code: 'RTR_ERR_LATE_READ' } }, 'a vLLM connector’s decoder: withheld', { body: connector.text })
  t.equal((await register('transfer-agent')).status, 200)
  const agent = await withFrozenDecoder(d, 2500, () => post(`${url}/v1/completions`, body))
  t.equal(agent.status, 200, 'a transfer agent’s decoder checks its own reads: passed on', { body: agent.text })
})

t.test('an assembled answer is the answer D gives whole', async (t) => {
  const checked = await cluster(t, 'router')
  const whole = await cluster(t, 'engine')
  for (const [path, req] of [
    ['/v1/completions', { ...body, prompt: ['one prompt here', 'and another prompt'], n: 2, max_tokens: 6 }],
    ['/v1/completions', { ...body, max_tokens: 12, stop: ['zz'] }],
    ['/v1/chat/completions', { model: MODEL, messages: [{ role: 'user', content: 'say something long' }], max_tokens: 9 }],
  ] as const) {
    const a = await post(`${checked.url}${path}`, req)
    const b = await post(`${whole.url}${path}`, req)
    t.equal(a.status, 200, `${path}: 200`, { body: a.text })
    const norm = (x: Record<string, unknown>) => ({
      object: x.object,
      model: x.model,
      usage: x.usage,
      choices: (x.choices as Record<string, unknown>[]).map((c) => ({ index: c.index, text: c.text, content: (c.message as { content?: unknown } | undefined)?.content, finish_reason: c.finish_reason })),
    })
    t.same(norm(a.json()), norm(b.json()), `${path} ${JSON.stringify(req).slice(0, 50)}: same choices, finish and usage`)
  }
  const s = await post(`${checked.url}/v1/completions`, { ...body, stream: true })
  t.ok(streamedText(s.text).length > 0, 'a streamed request is relayed as before')
})

t.test('a client that leaves while its answer is being assembled: client_gone, not a decoder failure', async (t) => {
  const p = await startSim(t, ['--role', 'prefill'])
  const d = await startSim(t, ['--role', 'decode', '--decode-delay-ms', '200'])
  const { url } = await startRouter(
    t,
    [
      { id: 'p0', role: 'prefill', url: p.url },
      { id: 'd0', role: 'decode', url: d.url },
    ],
    { probe: false, leases: { readCheck: 'router' } },
  )
  const ac = new AbortController()
  const gone = fetch(`${url}/v1/completions`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ ...body, max_tokens: 20 }), signal: ac.signal }).catch((e: unknown) => e)
  // D streams a token every 200 ms: the router is assembling by now.
  await sleep(600)
  ac.abort()
  t.ok((await gone) instanceof Error, 'the client left')
  const metrics = async () => (await fetch(`${url}/metrics`)).text()
  let text = await metrics()
  for (let i = 0; i < 50 && !/outcome="client_gone"/.test(text); i++) {
    await sleep(100)
    text = await metrics()
  }
  t.match(text, /handoff_router_requests_total\{mode="pd",outcome="client_gone"\} 1/, 'counted as the client’s leaving')
  t.notMatch(text, /handoff_router_upstream_errors_total\{leg="decode"/, 'not as a decoder failure')
  const next = await post(`${url}/v1/completions`, body)
  t.equal(next.status, 200, 'and D still serves')
})

t.test('readCheck auto: a transfer agent is trusted only while live (its stream open, or lately)', async (t) => {
  const AGENT = 'agent-token-read-check'
  const p = await startSim(t, ['--role', 'prefill'])
  const d = await startSim(t, ['--role', 'decode'])
  // Agents are trusted three keep-alive intervals after they were last connected: 300 ms here.
  const { url } = await startRouter(
    t,
    [
      { id: 'p0', role: 'prefill', url: p.url },
      { id: 'd0', role: 'decode', url: d.url },
    ],
    { probe: false, adminToken: ADMIN, agentToken: AGENT, events: { keepAliveMs: 100 }, leases: { leaseSeconds: 2, marginMs: 500, readCheck: 'auto' } },
  )
  const auth = { authorization: `Bearer ${AGENT}` }
  const reg = await post(`${url}/v1/agents`, { agentId: 'd0-agent', engineId: 'd0-engine', role: 'decode', agentUrl: 'http://127.0.0.1:7999', engineUrl: d.url, kind: 'transfer-agent' }, auth)
  t.equal(reg.status, 200)
  await sleep(500)
  const stale = await withFrozenDecoder(d, 2500, () => post(`${url}/v1/completions`, body))
  t.match(stale.json(), { error: { code: 'RTR_ERR_LATE_READ' } }, 'registered but never connected, and not lately: checked as stock', { body: stale.text })
  const ac = new AbortController()
  t.teardown(() => ac.abort())
  const stream = await fetch(`${url}/v1/agents/d0-agent/events`, { headers: auth, signal: ac.signal })
  t.equal(stream.status, 200, 'its event stream is open')
  await sleep(500)
  const live = await withFrozenDecoder(d, 2500, () => post(`${url}/v1/completions`, body))
  t.equal(live.status, 200, 'connected: its agent checks the read, the answer passes', { body: live.text })
})
