import t from 'tap'
import { decodeAlone, preferCached, type ChoiceReason, type Leg, type PrefixPreference } from '../../router/src/routing/prefix-choice.js'
import { tokenizeInput } from '../../router/src/routing/prompt-tokens.js'

/* Issue 39 part 3: the cost that weighs a candidate's cached share against its load (pure). */

interface C {
  id: string
  inflight: number
}

function prefer(cached: Record<string, number>, opts: { tokens?: number; loadWeight?: number; ratio?: number; slack?: number } = {}) {
  const chosen: [Leg, ChoiceReason, number][] = []
  const p: PrefixPreference = {
    tokens: opts.tokens ?? 100,
    holders: () => Object.keys(cached),
    cached: (id) => cached[id] ?? 0,
    prefill: { loadWeight: opts.loadWeight ?? 0.5 },
    decode: { loadWeight: 1 },
    guard: { ratio: opts.ratio ?? 1.5, slack: opts.slack ?? 2 },
    alone: () => undefined,
    chose: (leg, reason, n) => chosen.push([leg, reason, n]),
    wentAlone: () => undefined,
  }
  return { p, chosen }
}

const pool = (...cs: C[]) => {
  const m = new Map(cs.map((c) => [c.id, c]))
  return (id: string) => m.get(id)
}

t.test('nobody holds the prompt: the load pick, counted cold', async (t) => {
  const a = { id: 'a', inflight: 0 }
  const { p, chosen } = prefer({})
  t.equal(preferCached('prefill', a, pool(a, { id: 'b', inflight: 0 }), 0, p), a)
  t.same(chosen, [['prefill', 'cold', 0]])
})

t.test('a holder beats the load pick while what it saves outweighs its queue', async (t) => {
  const a = { id: 'a', inflight: 0 }
  const b = { id: 'b', inflight: 1 }
  const { p, chosen } = prefer({ b: 96 })
  // b: 1 - 0.96 + 0.5 × 1 = 0.54 < a: 1.
  t.equal(preferCached('prefill', a, pool(a, b), 0.5, p), b)
  t.same(chosen, [['prefill', 'prefix', 96]])

  const busy = { id: 'b', inflight: 2 }
  const again = prefer({ b: 96 })
  // b: 0.04 + 1 = 1.04 > a: 1, and within the guard (0.75 × 1.5 + 2).
  t.equal(preferCached('prefill', a, pool(a, busy), 1, again.p), a)
  t.same(again.chosen, [['prefill', 'load', 0]], 'the load pick won over a holder')
})

t.test('the load guard passes over a holder whatever the weights say', async (t) => {
  const a = { id: 'a', inflight: 0 }
  const b = { id: 'b', inflight: 3 }
  const free = prefer({ b: 100 }, { loadWeight: 0, ratio: 1, slack: 0 })
  t.equal(preferCached('prefill', a, pool(a, b), 3, free.p), b, 'within the bound (3 ≤ 3 × 1 + 0), the holder wins')
  const guarded = prefer({ b: 100 }, { loadWeight: 0, ratio: 1, slack: 0 })
  t.equal(preferCached('prefill', a, pool(a, b), 1.5, guarded.p), a, 'past it (3 > 1.5), it does not')
  t.same(guarded.chosen, [['prefill', 'cold', 0]], 'and no usable candidate held it')
})

t.test('the best holder of several; the load pick holding it counts as prefix; others are skipped', async (t) => {
  const a = { id: 'a', inflight: 0 }
  const b = { id: 'b', inflight: 0 }
  const c = { id: 'c', inflight: 0 }
  const { p } = prefer({ b: 32, c: 64, gone: 99 })
  t.equal(preferCached('decode', a, pool(a, b, c), 0, p), c, 'the longest hit at equal load; an id that is no open candidate is skipped')
  const self = prefer({ a: 64, b: 32 })
  t.equal(preferCached('single', a, pool(a, b), 0, self.p), a)
  t.same(self.chosen, [['single', 'prefix', 64]])
})

t.test("what a body asks /tokenize for", async (t) => {
  const body = (o: Record<string, unknown>) => (k: string) => o[k]
  t.same(tokenizeInput(false, body({ model: 'm', prompt: 'hi' })), { body: { model: 'm', prompt: 'hi' } })
  t.same(tokenizeInput(false, body({ model: 'm', prompt: ['hi'], add_special_tokens: false })), { body: { model: 'm', prompt: 'hi', add_special_tokens: false } })
  t.same(tokenizeInput(false, body({ model: 'm', prompt: [1, 2, 3] })), { tokens: [1, 2, 3] }, 'token ids need no call')
  t.same(tokenizeInput(false, body({ model: 'm', prompt: [[1, 2]] })), { tokens: [1, 2] })
  t.equal(tokenizeInput(false, body({ model: 'm', prompt: ['a', 'b'] })), undefined, 'a batch: load alone')
  const messages = [{ role: 'user', content: 'hi' }]
  t.same(
    tokenizeInput(true, body({ model: 'm', messages, add_generation_prompt: false, chat_template_kwargs: { x: 1 }, temperature: 0, tools: null })),
    { body: { model: 'm', messages, add_generation_prompt: false, chat_template_kwargs: { x: 1 } } },
    'the fields that change the rendering, nothing else',
  )
})

t.test('decode-only: the decoder holding the most, if it may serve the prompt alone', async (t) => {
  const a = { id: 'a', inflight: 0 }
  const b = { id: 'b', inflight: 0 }
  const mk = (maxUncached: number) => {
    const { p, chosen } = prefer({ a: 32, b: 96 })
    const gone: string[] = []
    const q: PrefixPreference = { ...p, alone: (cached) => (cached > 0 && 100 - cached <= maxUncached ? 'held' : undefined), wentAlone: (r) => gone.push(r) }
    return { q, chosen, gone }
  }
  const yes = mk(8)
  t.equal(decodeAlone(pool(a, b), 0, yes.q), b, 'b holds all but 4 of 100 tokens')
  t.same([yes.chosen, yes.gone], [[['single', 'prefix', 96]], ['held']])
  const no = mk(2)
  t.equal(decodeAlone(pool(a, b), 0, no.q), undefined, 'all but 4 is more than 2: a P/D route')
  t.same([no.chosen, no.gone], [[], []])
  const busy = mk(8)
  t.equal(decodeAlone(pool(a, { id: 'b', inflight: 9 }), 1, busy.q), undefined, 'the holder past the load guard is not sent it alone, and a holds too little')
})
