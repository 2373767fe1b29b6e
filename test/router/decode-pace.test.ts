import t from 'tap'
import { DecodePace, generatedTokens, maxTokensOf } from '../../router/src/leases/decode-pace.js'

t.test('a pace is trusted after 8 answers, and only for a bounded request', async (t) => {
  const pace = new DecodePace()
  for (let i = 0; i < 7; i++) pace.observe('d0', 40, 8)
  t.notOk(pace.fits('d0', 8, 30_000), '7 answers: not yet')
  pace.observe('d0', 40, 8)
  t.ok(pace.fits('d0', 8, 30_000), '8 answers of 5 ms a token: 8 tokens fit in 30 s')
  t.notOk(pace.fits('d0', undefined, 30_000), 'no max_tokens: never')
  t.notOk(pace.fits('d1', 8, 30_000), 'another decoder: not known')
  // 5 ms a token, doubled: 3,000 tokens need 30 s.
  t.ok(pace.fits('d0', 3000, 30_000))
  t.notOk(pace.fits('d0', 3001, 30_000), 'past half the window: not')
})

t.test('a slower decoder shows within a span of tokens; a faster one as soon', async (t) => {
  const pace = new DecodePace()
  for (let i = 0; i < 8; i++) pace.observe('d0', 10, 10)
  t.ok(pace.fits('d0', 100, 200), '1 ms a token')
  // 100 ms a token from now on: after 70 tokens of it the span holds nothing else.
  for (let i = 0; i < 7; i++) pace.observe('d0', 1000, 10)
  t.notOk(pace.fits('d0', 10, 1999), '10 tokens at 100 ms, doubled: 2 s')
  t.ok(pace.fits('d0', 10, 2000))
  for (let i = 0; i < 7; i++) pace.observe('d0', 10, 10)
  t.ok(pace.fits('d0', 100, 200), 'fast again for a span: 1 ms a token again')
  pace.forget('d0')
  t.notOk(pace.fits('d0', 1, 1e9), 'forgotten: unknown again')
})

t.test('one 1-token answer that queued behind long ones does not switch the proof off (issue 37 item 4)', async (t) => {
  // A 4 s window (5 s leases, 1 s margin); 16-token answers at 5 ms a token.
  const pace = new DecodePace()
  const window = 4000
  for (let i = 0; i < 12; i++) pace.observe('d0', 80, 16)
  t.ok(pace.fits('d0', 16, window), 'known and fast: the proof applies')
  pace.observe('d0', 2000, 1)
  let fit = 0
  for (let i = 0; i < 100; i++) {
    if (pace.fits('d0', 16, window)) fit++
    pace.observe('d0', 80, 16)
  }
  t.equal(fit, 100, `the next 100 answers took the proof (${fit})`)
  // A decoder whose short answers are all slow is slow: enough of them do count.
  for (let i = 0; i < 64; i++) pace.observe('d0', 2000, 1)
  t.notOk(pace.fits('d0', 16, window), 'a span of slow 1-token answers: not')
})

t.test('a leg dropped at its deadline counts as at least that long for its max_tokens', async (t) => {
  const pace = new DecodePace()
  for (let i = 0; i < 8; i++) pace.observe('d0', 80, 16)
  t.ok(pace.fits('d0', 64, 4000))
  // A 64-token leg gave up after 3.9 s: the decoder is slower than it looked.
  pace.tooSlow('d0', 3900, 64)
  t.notOk(pace.fits('d0', 64, 4000), 'the same leg no longer looks like it fits')
  const cold = new DecodePace()
  for (let i = 0; i < 8; i++) cold.tooSlow('d1', 1000, 16)
  t.notOk(cold.fits('d1', 1, 1e9), 'dropped legs are no answers: the pace is still not known')
})

t.test('an answer with no tokens, or a nonsense time, is not a sample', async (t) => {
  const pace = new DecodePace()
  for (let i = 0; i < 8; i++) pace.observe('d0', 5, 0)
  pace.observe('d0', -1, 5)
  pace.observe('d0', Number.NaN, 5)
  t.notOk(pace.fits('d0', 1, 1e9))
})

t.test('maxTokensOf and generatedTokens', async (t) => {
  const of = (b: Record<string, unknown>) => maxTokensOf((m) => b[m])
  t.equal(of({ max_tokens: 16 }), 16)
  t.equal(of({ max_completion_tokens: 9 }), 9)
  t.equal(of({ max_tokens: 4, max_completion_tokens: 9 }), 9, 'the larger: an upper bound whichever vLLM uses')
  t.equal(of({}), undefined)
  t.equal(of({ max_tokens: 0 }), undefined)
  t.equal(of({ max_tokens: 2.5 }), undefined)
  // vLLM's pydantic models coerce these (checked against vLLM 0.32).
  t.equal(of({ max_tokens: '8' }), 8)
  t.equal(of({ max_tokens: ' 8 ' }), 8)
  t.equal(of({ max_tokens: '+8' }), 8)
  t.equal(of({ max_tokens: '8.0' }), 8)
  t.equal(of({ max_tokens: '1_000' }), 1000)
  t.equal(of({ max_tokens: '8.5' }), undefined)
  t.equal(of({ max_tokens: 'eight' }), undefined)
  t.equal(of({ max_tokens: true }), undefined)
  t.equal(generatedTokens({ usage: { completion_tokens: 7 } }), 7)
  t.equal(generatedTokens({ usage: {} }), undefined)
  t.equal(generatedTokens(undefined), undefined)
  t.equal(generatedTokens('text'), undefined)
})
