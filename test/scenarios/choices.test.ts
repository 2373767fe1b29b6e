import t from 'tap'
import { oracleForBody } from '../../sim/src/oracle.js'
import { needNixl, probeNixl } from '../native/helpers.js'
import { post, sseEvents } from '../helpers/cluster.js'
import { metric, REUSING_PREFILLER, startEngine, startRouterProcess } from '../helpers/pd-agents.js'

/*
 * Issue 17 item 7: `n > 1`. vLLM's decoder loads the remote KV once per choice, while P's
 * lease is for one read: P frees the blocks after the first READ and the other choices read
 * blocks P may have reused (P logs "Potentially invalid KV blocks for unrecognized request").
 * The simulator's decoder does the same (one pull per choice) and P's agent counts those
 * reads. The router runs n > 1 as n handoffs of n: 1, one lease each, and merges the choices
 * with their indices, streamed and not, for completions (batches too) and chat.
 */

const probe = await probeNixl()
type Choice = { index: number; text?: string; message?: { content: string }; finish_reason: string }

t.test('n > 1: one handoff (one lease, one READ) per choice, merged in order', { skip: needNixl(t, probe) }, async (t) => {
  const prefill = await startEngine(t, { role: 'prefill', leaseSeconds: 10, simArgs: [...REUSING_PREFILLER] })
  const decode = await startEngine(t, { role: 'decode', leaseSeconds: 10, simArgs: ['--kv-load-failure-policy', 'fail'] })
  const router = await startRouterProcess(t, [prefill, decode])
  const url = router.url

  const completion = { model: 'handoff/sim-1', prompt: 'n choices of the quick brown fox', max_tokens: 6, n: 3 }
  const res = await post(`${url}/v1/completions`, completion)
  t.equal(res.status, 200, res.text)
  const body = res.json<{ choices: Choice[]; usage: { prompt_tokens: number; completion_tokens: number; total_tokens: number } }>()
  const want = oracleForBody('/v1/completions', { prompt: completion.prompt, max_tokens: completion.max_tokens })
  t.same(body.choices.map((c) => [c.index, c.text]), [0, 1, 2].map((i) => [i, want]), 'three choices, indices 0..2, each the oracle text')
  const single = (await post(`${url}/v1/completions`, { ...completion, n: 1 })).json<{ usage: { prompt_tokens: number; completion_tokens: number } }>().usage
  t.same(body.usage, { prompt_tokens: single.prompt_tokens, completion_tokens: 3 * single.completion_tokens, total_tokens: single.prompt_tokens + 3 * single.completion_tokens }, 'the prompt counted once, the completions summed')

  const streamed = await post(`${url}/v1/completions`, { ...completion, n: 2, stream: true, stream_options: { include_usage: true } })
  t.equal(streamed.status, 200)
  const events = sseEvents(streamed.text).filter((e): e is Record<string, unknown> => e !== '[DONE]')
  const texts = ['', '']
  for (const e of events) for (const c of (e.choices as Choice[] | undefined) ?? []) texts[c.index] += c.text ?? ''
  t.same(texts, [want, want], 'streamed: both choices, each the oracle text')
  t.match(events.at(-1), { choices: [], usage: { prompt_tokens: single.prompt_tokens, completion_tokens: 2 * single.completion_tokens } }, 'one usage chunk at the end')
  t.equal(sseEvents(streamed.text).filter((e) => e === '[DONE]').length, 1)

  const chat = { model: 'handoff/sim-1', messages: [{ role: 'user', content: 'Two answers please' }], max_tokens: 5, n: 2 }
  const chatWant = oracleForBody('/v1/chat/completions', { messages: chat.messages, max_tokens: chat.max_tokens })
  const c = (await post(`${url}/v1/chat/completions`, chat)).json<{ object: string; choices: Choice[] }>()
  t.equal(c.object, 'chat.completion')
  t.same(c.choices.map((x) => [x.index, x.message?.content]), [[0, chatWant], [1, chatWant]], 'chat: both choices')
  const cs = await post(`${url}/v1/chat/completions`, { ...chat, stream: true })
  const chatTexts = ['', '']
  for (const e of sseEvents(cs.text)) {
    if (e === '[DONE]') continue
    t.equal(e.object, 'chat.completion.chunk')
    for (const x of (e.choices as { index: number; delta: { content?: string } }[]) ?? []) chatTexts[x.index] += x.delta.content ?? ''
  }
  t.same(chatTexts, [chatWant, chatWant], 'chat streamed: both choices')

  // A batch with n: prompt-major indices, as vLLM numbers them.
  const batch = { model: 'handoff/sim-1', prompt: ['first prompt of a batch', 'second prompt of a batch'], max_tokens: 4, n: 2 }
  const b = (await post(`${url}/v1/completions`, batch)).json<{ choices: Choice[] }>()
  const w = batch.prompt.map((p) => oracleForBody('/v1/completions', { prompt: p, max_tokens: batch.max_tokens }))
  t.same(b.choices.map((x) => [x.index, x.text]), [[0, w[0]], [1, w[0]], [2, w[1]], [3, w[1]]], 'batch × n: prompt-major')

  const unknown = await metric(prefill.agent.url, 'handoff_agent_read_done_unknown_total')
  t.equal(unknown, 0, 'P never saw a READ of blocks no lease held (one lease per choice)')
  const leases = await metric(url, 'handoff_router_leases_issued_total')
  t.equal(leases, 3 + 1 + 2 + 2 + 2 + 4, 'one lease per choice')
  t.equal(await metric(decode.agent.url, 'handoff_agent_pulls_total', { outcome: 'ok' }), leases, 'and one READ per lease')
})
