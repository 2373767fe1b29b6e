import t from 'tap'
import { prefillFacts, withPrefillFacts } from '../../router/src/proxy/prefill-facts.js'
import { withUsageFacts } from '../../router/src/proxy/relay.js'

const logprobs = [null, { '7': { logprob: -1.5, rank: 1, decoded_token: 'a' } }]

t.test('completions: per-choice prompt_logprobs and the cached-token count come from P', async (t) => {
  const p = { choices: [{ index: 0, text: 'x', prompt_logprobs: logprobs }], usage: { prompt_tokens: 2, prompt_tokens_details: { cached_tokens: 7 } } }
  const facts = prefillFacts(p, false)
  t.same(facts, { promptLogprobs: logprobs, cachedTokens: 7 })
  const d = { choices: [{ index: 0, text: 'a' }, { index: 1, text: 'b', prompt_logprobs: null }], usage: { prompt_tokens: 2, prompt_tokens_details: { cached_tokens: -1, other: 1 } } }
  const merged = withPrefillFacts(d, facts as NonNullable<typeof facts>, false) as typeof d & { choices: { prompt_logprobs?: unknown }[] }
  t.same(merged.choices.map((c) => c.prompt_logprobs), [logprobs, logprobs], 'every choice')
  t.same(merged.usage.prompt_tokens_details, { cached_tokens: 7, other: 1 }, 'the count replaced, the other details kept')
})

t.test('chat: prompt_logprobs at the top level', async (t) => {
  const facts = prefillFacts({ prompt_logprobs: logprobs, choices: [{ index: 0, prompt_logprobs: 'ignored' }] }, true)
  t.same(facts, { promptLogprobs: logprobs })
  t.same(withPrefillFacts({ choices: [], prompt_logprobs: null }, facts as NonNullable<typeof facts>, true).prompt_logprobs, logprobs)
})

t.test('nothing to carry: undefined, and D’s answer is left alone', async (t) => {
  t.equal(prefillFacts({ choices: [{ prompt_logprobs: null }], usage: { prompt_tokens: 3 } }, false), undefined)
  t.equal(prefillFacts('not an object', false), undefined)
  t.equal(prefillFacts({ choices: [] }, true), undefined)
  const d = { choices: [{ index: 0 }], usage: null }
  t.same(withPrefillFacts(d, { cachedTokens: 3 }, false), { choices: [{ index: 0 }], usage: null }, 'no usage to put it in')
})

t.test('a stream: the usage chunk gets P’s cached-token count, other frames go out as they came', async (t) => {
  const frames = Buffer.from(
    'data: {"id":"c","choices":[{"index":0,"text":"a"}]}\n\n' +
      'data: {"id":"c","choices":[],"usage":{"prompt_tokens":9,"completion_tokens":2,"total_tokens":11,"prompt_tokens_details":{"cached_tokens":0}}}\n\n' +
      'data: [DONE]\n\n',
  )
  const out = withUsageFacts(frames, { cachedTokens: 7, promptLogprobs: [null] }, false).toString()
  const events = out.split('\n\n').filter(Boolean)
  t.equal(events[0], 'data: {"id":"c","choices":[{"index":0,"text":"a"}]}', 'a token frame is untouched')
  t.same(JSON.parse((events[1] as string).slice(6)).usage, { prompt_tokens: 9, completion_tokens: 2, total_tokens: 11, prompt_tokens_details: { cached_tokens: 7 } })
  t.equal(events[2], 'data: [DONE]')
  const none = Buffer.from('data: {"id":"c","choices":[{"index":0,"text":"a"}],"usage":null}\n\n')
  t.equal(withUsageFacts(none, { cachedTokens: 7 }, false), none, 'no usage object: the same buffer')
})
