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

t.test('it rises at once with a slower answer and falls slowly', async (t) => {
  const pace = new DecodePace()
  for (let i = 0; i < 8; i++) pace.observe('d0', 10, 10)
  t.ok(pace.fits('d0', 100, 200), '1 ms a token')
  pace.observe('d0', 1000, 10)
  t.notOk(pace.fits('d0', 100, 200), 'one answer of 100 ms a token: at once')
  t.notOk(pace.fits('d0', 10, 1999), '10 tokens at 100 ms, doubled: 2 s')
  for (let i = 0; i < 10; i++) pace.observe('d0', 10, 10)
  t.notOk(pace.fits('d0', 10, 1500), 'ten fast answers later it is still above 75 ms a token')
  for (let i = 0; i < 400; i++) pace.observe('d0', 10, 10)
  t.ok(pace.fits('d0', 100, 250), 'after hundreds it is back near 1 ms')
  pace.forget('d0')
  t.notOk(pace.fits('d0', 1, 1e9), 'forgotten: unknown again')
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
  t.equal(of({ max_tokens: '8' }), undefined)
  t.equal(generatedTokens({ usage: { completion_tokens: 7 } }), 7)
  t.equal(generatedTokens({ usage: {} }), undefined)
  t.equal(generatedTokens(undefined), undefined)
  t.equal(generatedTokens('text'), undefined)
})
