import t from 'tap'
import { ManualClock } from '../../common/clock.js'
import { oracleForBody, oracleOutput, oracleText } from '../../sim/src/oracle.js'
import { stopCriteria } from '../../sim/src/prompt.js'
import { applyStop, EOS_TOKEN_ID, NO_STOP } from '../../sim/src/stop.js'
import { build, MODEL, parseSse } from './build.js'
import { FakeKv } from './fake-kv.js'

const PROMPT = 'Tell me a story about stop criteria'
// The unstopped answer: the tests pick stop tokens and strings from it.
const plain = oracleOutput({ kind: 'completion', prompt: PROMPT, maxTokens: 8 })

t.test('applyStop: EOS, stop token ids, stop strings, min_tokens, ignore_eos', async (t) => {
  const sampled = plain.tokens
  t.equal(EOS_TOKEN_ID, 64, 'one past the 64 words')
  t.same(applyStop(sampled, NO_STOP), { ...plain, finishReason: 'length', stopReason: null })
  t.equal(plain.pieces.join(''), plain.text)

  const eos = applyStop(sampled, { ...NO_STOP, eosAfterTokens: 3 })
  t.same(eos.tokens, [sampled[0], sampled[1], EOS_TOKEN_ID], 'EOS is sampled as token 3 and counted')
  t.equal(eos.text, plain.pieces.slice(0, 2).join(''), 'its text is left out')
  t.same([eos.finishReason, eos.stopReason], ['stop', null])
  t.equal(applyStop(sampled, { ...NO_STOP, eosAfterTokens: 3, ignoreEos: true }).finishReason, 'length', 'ignore_eos')
  t.equal(applyStop(sampled, { ...NO_STOP, eosAfterTokens: 3, minTokens: 3 }).finishReason, 'length', 'EOS masked up to min_tokens')
  t.equal(applyStop(sampled, { ...NO_STOP, eosAfterTokens: 4, minTokens: 3 }).tokens.length, 4, 'EOS honoured past min_tokens')
  t.equal(applyStop(sampled, { ...NO_STOP, eosAfterTokens: 9 }).finishReason, 'length', 'EOS after max_tokens never comes')

  const k = 3
  const id = sampled[k] as number
  const first = sampled.indexOf(id)
  const byId = applyStop(sampled, { ...NO_STOP, stopTokenIds: [id] })
  t.equal(byId.tokens.length, first + 1)
  t.equal(byId.text, plain.pieces.slice(0, first).join(''), 'stop token text left out')
  t.same([byId.finishReason, byId.stopReason], ['stop', id])
  const late = applyStop(sampled, { ...NO_STOP, stopTokenIds: [id], minTokens: first + 1 })
  t.ok(late.tokens.length > first + 1 || late.finishReason === 'length', 'stop token id not honoured up to min_tokens')

  // A stop string across two tokens: the text is cut before it, the token pieces clipped.
  const w1 = plain.pieces[1] as string
  const w2 = plain.pieces[2] as string
  const across = w1.slice(-2) + w2.slice(0, 3)
  const cut = applyStop(sampled, { ...NO_STOP, stop: ['never-there', across] })
  const at = plain.text.indexOf(across)
  t.equal(cut.text, plain.text.slice(0, at))
  t.equal(cut.tokens.length, 3)
  t.equal(cut.pieces.join(''), cut.text)
  t.equal(cut.pieces[2], '', 'the token completing the match adds nothing')
  t.same([cut.finishReason, cut.stopReason], ['stop', across])
  // List order decides between two strings completed by the same token (vLLM's loop).
  const both = applyStop(sampled, { ...NO_STOP, stop: [w2.trim(), w2] })
  t.equal(both.stopReason, w2.trim())
  t.equal(applyStop(sampled, { ...NO_STOP, stop: [''] }).finishReason, 'length', 'empty stop strings are ignored')
  const masked = applyStop(sampled, { ...NO_STOP, stop: [w1.trim()], minTokens: 2 })
  t.ok(masked.tokens.length > 2, 'stop strings are checked only past min_tokens')

  t.same(stopCriteria({ stop: 'x', minTokens: 2 }, 5), { stop: ['x'], stopTokenIds: [], ignoreEos: false, minTokens: 2, eosAfterTokens: 5 })
})

t.test('completions and chat stop like vLLM, streamed or not, and match the oracle', async (t) => {
  const { app } = build(t)
  const word = (plain.pieces[2] as string).trim()
  const body = { model: MODEL, prompt: PROMPT, max_tokens: 8, stop: word }
  const r = await app.inject({ method: 'POST', url: '/v1/completions', payload: body })
  t.equal(r.statusCode, 200)
  const choice = r.json().choices[0]
  t.equal(choice.text, oracleForBody('/v1/completions', body))
  t.equal(choice.text, plain.text.slice(0, plain.text.indexOf(word)), 'stop string excluded')
  t.same([choice.finish_reason, choice.stop_reason], ['stop', word])
  t.equal(r.json().usage.completion_tokens, 3)

  const messages = [{ role: 'user', content: PROMPT }]
  const chatPlain = oracleOutput({ kind: 'chat', messages, maxTokens: 6 })
  const id = chatPlain.tokens[1] as number
  const chatBody = { model: MODEL, messages, max_tokens: 6, stream: true, stop_token_ids: [id], stream_options: { include_usage: true } }
  const s = await app.inject({ method: 'POST', url: '/v1/chat/completions', payload: chatBody })
  const { frames, done } = parseSse(s.body)
  t.ok(done)
  const choices = frames.map((f) => (f.choices as { delta?: { content?: string }; finish_reason: string | null; stop_reason?: unknown }[])[0])
  t.equal(choices.map((c) => c?.delta?.content ?? '').join(''), oracleForBody('/v1/chat/completions', chatBody))
  const last = choices.filter(Boolean).at(-1)
  t.same([last?.finish_reason, last?.stop_reason], ['stop', id])
  t.equal((frames.at(-1)?.usage as { completion_tokens: number }).completion_tokens, chatPlain.tokens.indexOf(id) + 1)

  // Streamed completion with a stop string: chunks never show any of the stop string.
  const streamed = await app.inject({ method: 'POST', url: '/v1/completions', payload: { ...body, stream: true } })
  const texts = parseSse(streamed.body).frames.map((f) => (f.choices as { text: string }[])[0]?.text ?? '')
  t.equal(texts.join(''), choice.text)

  const m = (await app.inject({ url: '/metrics' })).body
  t.match(m, 'vllm:request_success_total{model_name="handoff/sim-1",engine="0",finished_reason="stop"} 3')
})

t.test('EOS from the eosAfterTokens fault; ignore_eos and min_tokens', async (t) => {
  const { app } = build(t, { faults: { eosAfterTokens: 2 } })
  const body = { model: MODEL, prompt: PROMPT, max_tokens: 8 }
  const r = (await app.inject({ method: 'POST', url: '/v1/completions', payload: body })).json()
  t.same([r.choices[0].finish_reason, r.choices[0].stop_reason, r.usage.completion_tokens], ['stop', null, 2])
  t.equal(r.choices[0].text, oracleForBody('/v1/completions', body, { eosAfterTokens: 2 }))
  t.equal(r.choices[0].text, plain.pieces[0])
  const ignored = (await app.inject({ method: 'POST', url: '/v1/completions', payload: { ...body, ignore_eos: true } })).json()
  t.same([ignored.choices[0].finish_reason, ignored.choices[0].text], ['length', plain.text])
  const min = (await app.inject({ method: 'POST', url: '/v1/completions', payload: { ...body, min_tokens: 2 } })).json()
  t.equal(min.choices[0].finish_reason, 'length', 'no EOS up to min_tokens')

  t.match((await app.inject({ method: 'POST', url: '/sim/faults', payload: { eosAfterTokens: 1 } })).json(), { eosAfterTokens: 1 })
  const one = (await app.inject({ method: 'POST', url: '/v1/completions', payload: body })).json()
  t.same([one.choices[0].text, one.usage.completion_tokens], ['', 1])
  const cleared = (await app.inject({ method: 'POST', url: '/sim/faults', payload: { eosAfterTokens: null } })).json()
  t.equal(cleared.eosAfterTokens, undefined)
  const back = (await app.inject({ method: 'POST', url: '/v1/completions', payload: body })).json()
  t.equal(back.choices[0].text, oracleText({ kind: 'completion', prompt: PROMPT, maxTokens: 8 }))
})

t.test('bad stop fields and n < 1 are refused', async (t) => {
  const { app } = build(t)
  const cases: [Record<string, unknown>, string][] = [
    [{ stop: 5 }, 'SIM_ERR_BAD_REQUEST'],
    [{ stop: ['a', 1] }, 'SIM_ERR_BAD_REQUEST'],
    [{ stop_token_ids: ['a'] }, 'SIM_ERR_BAD_REQUEST'],
    [{ ignore_eos: 'yes' }, 'SIM_ERR_BAD_REQUEST'],
  ]
  for (const [extra, code] of cases) {
    const r = await app.inject({ method: 'POST', url: '/v1/completions', payload: { model: MODEL, prompt: 'x', ...extra } })
    t.equal(r.statusCode, 400, JSON.stringify(extra))
    t.equal(r.json().error.code, code)
  }
  const ok = await app.inject({ method: 'POST', url: '/v1/completions', payload: { model: MODEL, prompt: 'x', n: 1, stop: null, stop_token_ids: null, ignore_eos: false } })
  t.equal(ok.statusCode, 200)
  t.equal((await app.inject({ method: 'POST', url: '/v1/completions', payload: { model: MODEL, prompt: 'x', n: 0 } })).statusCode, 400, 'n: 0 is refused')
  const two = (await app.inject({ method: 'POST', url: '/v1/completions', payload: { model: MODEL, prompt: 'x', n: 2, max_tokens: 3 } })).json()
  const text = oracleText({ kind: 'completion', prompt: 'x', maxTokens: 3 })
  t.same(
    two.choices.map((c: { index: number; text: string }) => [c.index, c.text]),
    [
      [0, text],
      [1, text],
    ],
    'n: 2 answers two choices (the simulator is deterministic: both the same text)',
  )
  const one = (await app.inject({ method: 'POST', url: '/v1/completions', payload: { model: MODEL, prompt: 'x', max_tokens: 3 } })).json()
  t.equal(two.usage.completion_tokens, 2 * one.usage.completion_tokens, 'completion tokens of both choices')
  t.equal(two.usage.prompt_tokens, one.usage.prompt_tokens, 'the prompt once')
})

t.test('prefill leg: a stop finish returns no kv_transfer_params and frees the blocks', async (t) => {
  const kv = new FakeKv({ clock: new ManualClock() })
  const p = build(t, { role: 'prefill', kv: 'agent', agentUrl: 'http://127.0.0.1:9', numGpuBlocksOverride: 64 }, { kvTransport: kv.transport() })
  const leg = { model: MODEL, prompt: PROMPT, max_tokens: 1, stream: false, kv_transfer_params: { do_remote_decode: true } }
  const info = async (): Promise<{ leases: number; usedBlocks: number }> => (await p.app.inject({ url: '/sim/info' })).json()

  const first = plain.tokens[0] as number
  const byId = await p.app.inject({ method: 'POST', url: '/v1/completions', headers: { 'x-request-id': 'stop-id' }, payload: { ...leg, stop_token_ids: [first] } })
  t.equal(byId.statusCode, 200)
  t.same([byId.json().choices[0].finish_reason, byId.json().kv_transfer_params], ['stop', null])
  t.match(await info(), { leases: 0, usedBlocks: 0 }, 'no lease, blocks freed at once')

  const byString = (await p.app.inject({ method: 'POST', url: '/v1/completions', payload: { ...leg, stop: [(plain.pieces[0] as string).trim()] } })).json()
  t.same([byString.choices[0].finish_reason, byString.kv_transfer_params], ['stop', null])

  await p.app.inject({ method: 'POST', url: '/sim/faults', payload: { eosAfterTokens: 1 } })
  const eos = (await p.app.inject({ method: 'POST', url: '/v1/completions', payload: leg })).json()
  t.same([eos.choices[0].finish_reason, eos.choices[0].text, eos.kv_transfer_params], ['stop', '', null], 'EOS as the one token')
  t.match(await info(), { leases: 0, usedBlocks: 0 })

  const forced = (await p.app.inject({ method: 'POST', url: '/v1/completions', headers: { 'x-request-id': 'forced' }, payload: { ...leg, ignore_eos: true } })).json()
  t.equal(forced.choices[0].finish_reason, 'length', 'the router forces a length finish with ignore_eos')
  t.type(forced.kv_transfer_params.remote_request_id, 'string')
  t.match(await info(), { leases: 1 })

  const log = (await p.app.inject({ url: '/sim/requests' })).json().requests as Record<string, unknown>[]
  t.match(log[0], { xRequestId: 'stop-id', finishReason: 'stop', stopReason: first, kvTransferParams: null })
  t.match(log[2], { xRequestId: null, finishReason: 'stop', stopReason: null, kvTransferParams: null })
  t.match(log[3], { xRequestId: 'forced', finishReason: 'length', stopReason: null, kvTransferParams: { remote_request_id: forced.kv_transfer_params.remote_request_id } })
})
