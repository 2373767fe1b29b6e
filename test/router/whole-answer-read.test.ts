import t from 'tap'
import { setTimeout as sleep } from 'node:timers/promises'
import type { RouterConfig } from '../../schemas/router-config.js'
import { post, startRouter, startSim } from '../helpers/cluster.js'

/*
 * leases.proveByWholeAnswer (issue 23): where the router checks D's reads, a non-streamed
 * request's decode leg used to be streamed from D and assembled, so that D's first token could
 * be held against the read deadline. D's whole answer arriving before that deadline proves the
 * same, since the read comes before the first token and the first token before the end. The
 * router takes that proof when the decoder's recent pace says the answer ends well within the
 * window; one that does not arrive in time is dropped and the prompt prefilled again, with a
 * streamed leg. Real simulator processes; D is frozen (SIGSTOP) past the window.
 */
const MODEL = 'handoff/sim-1'
const body = { model: MODEL, prompt: 'the quick brown fox jumps over the lazy dog', max_tokens: 4 }

async function cluster(t: Parameters<typeof startSim>[0], leases: Partial<RouterConfig['leases']>) {
  const p = await startSim(t, ['--role', 'prefill'])
  const d = await startSim(t, ['--role', 'decode'])
  const router = await startRouter(
    t,
    [
      { id: 'p0', role: 'prefill', url: p.url },
      { id: 'd0', role: 'decode', url: d.url },
    ],
    { probe: false, leases: { readCheck: 'router', ...leases } },
  )
  return { ...router, p, d }
}

async function counters(url: string): Promise<{ whole: number; unproven: number; late: number }> {
  const text = await (await fetch(`${url}/metrics`)).text()
  const n = (name: string) => Number(new RegExp(`^${name} (\\d+)`, 'm').exec(text)?.[1] ?? NaN)
  return { whole: n('handoff_router_whole_answer_reads_total'), unproven: n('handoff_router_unproven_reads_total'), late: n('handoff_router_late_reads_total') }
}

/** The parts of an answer that must not depend on how D's read was proven. */
const norm = (x: Record<string, unknown>) => ({
  object: x.object,
  model: x.model,
  usage: x.usage,
  choices: (x.choices as Record<string, unknown>[]).map((c) => ({ index: c.index, text: c.text, content: (c.message as { content?: unknown } | undefined)?.content, finish_reason: c.finish_reason })),
})

t.test('a decoder with a known pace: the read is proven by its whole answer, which is the answer an assembled stream gives', async (t) => {
  const whole = await cluster(t, {})
  const streamed = await cluster(t, { proveByWholeAnswer: false })
  // Until D has answered 8 times its pace is unknown: every leg is streamed and assembled.
  for (let i = 0; i < 8; i++) t.equal((await post(`${whole.url}/v1/completions`, body)).status, 200)
  t.equal((await counters(whole.url)).whole, 0, 'no whole-answer proof before D’s pace is known')
  for (const [path, req] of [
    ['/v1/completions', body],
    ['/v1/completions', { ...body, prompt: ['one prompt here', 'and another prompt'], n: 2, max_tokens: 6 }],
    ['/v1/chat/completions', { model: MODEL, messages: [{ role: 'user', content: 'say something long' }], max_completion_tokens: 9 }],
  ] as const) {
    const before = (await counters(whole.url)).whole
    const a = await post(`${whole.url}${path}`, req)
    const b = await post(`${streamed.url}${path}`, req)
    t.equal(a.status, 200, `${path}: 200`, { body: a.text })
    t.same(norm(a.json()), norm(b.json()), `${path} ${JSON.stringify(req).slice(0, 50)}: the same choices, finish and usage as assembled`)
    const handoffs = 'n' in req ? 4 : 1
    t.equal((await counters(whole.url)).whole - before, handoffs, `${handoffs} read(s) proven by the whole answer`)
  }
  const before = await counters(whole.url)
  const { max_tokens: _, ...unbounded } = body
  t.equal((await post(`${whole.url}/v1/completions`, unbounded)).status, 200)
  t.equal((await post(`${whole.url}/v1/completions`, { ...body, stream: true })).status, 200)
  t.equal((await counters(whole.url)).whole, before.whole, 'without max_tokens, or streamed to the client, D’s first token is watched as before')
  t.equal((await counters(streamed.url)).whole, 0, 'proveByWholeAnswer false: never')
})

t.test('onLapsed fail: no whole-answer proof, since one that fails would need a second prefill', async (t) => {
  const { url } = await cluster(t, { onLapsed: 'fail' })
  for (let i = 0; i < 12; i++) t.equal((await post(`${url}/v1/completions`, body)).status, 200)
  t.equal((await counters(url)).whole, 0)
})

t.test('D’s whole answer past the read window: dropped, prefilled again with a streamed leg, answered in time', async (t) => {
  // A 2.5 s read window (3 s lease, 500 ms margin); D frozen for 3.2 s.
  const { url, d, logs } = await cluster(t, { leaseSeconds: 3, marginMs: 500 })
  for (let i = 0; i < 10; i++) t.equal((await post(`${url}/v1/completions`, body)).status, 200)
  t.equal((await counters(url)).whole, 2, 'D’s pace is known: the 9th and 10th reads were proven whole')
  const reference = await post(`${url}/v1/completions`, body)
  d.child.kill('SIGSTOP')
  const answer = post(`${url}/v1/completions`, body)
  await sleep(3200)
  d.child.kill('SIGCONT')
  const a = await answer
  // The second prefill's lease runs from about 2.5 s: D's first token at about 3.2 s is in its window.
  t.equal(a.status, 200, 'answered', { body: a.text })
  t.same(norm(a.json()), norm(reference.json()), 'with the same answer as before the freeze')
  const c = await counters(url)
  t.equal(c.unproven, 1, 'one unproven read, prefilled again')
  t.equal(c.late, 0, 'the second, streamed leg’s first token came in time')
  t.ok(logs.some((l) => /prefilling again, with a streamed decode leg/.test(String(l.msg))), 'logged')
})
