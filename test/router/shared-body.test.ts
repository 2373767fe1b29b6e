import t from 'tap'
import { SPLIT_MEMBERS, splitRequest } from '../../router/src/proxy/batch.js'
import { decodeBody, decodeView, LEG_MEMBERS, prefillBody, prefillView, withoutClientParams } from '../../router/src/proxy/legs.js'
import { SharedBody, type BodyView } from '../../router/src/proxy/shared-body.js'

// Issue 18 item 3: every leg's body is a view of the client's, serialised once. The wire
// bytes must be exactly what JSON.stringify of the same body as an object gives.

const text = (v: BodyView): string => Buffer.concat(v.payload().chunks).toString('utf8')
const root = (body: Record<string, unknown>): BodyView => new SharedBody(withoutClientParams(body), [...LEG_MEMBERS, ...SPLIT_MEMBERS]).view()

const bodies: Record<string, unknown>[] = [
  { model: 'm', prompt: 'x' },
  { model: 'm', prompt: 'x', max_tokens: 9, stream: true, stream_options: { include_usage: true }, stop: ['\n'], temperature: 0.2, extra: { deep: [1, { a: 'é"\\' }] } },
  { stream: true, model: 'm', n: 3, seed: 5, prompt: ['a', 'b'], best_of: 3, max_completion_tokens: 4, min_tokens: 1, tail: null },
  // Integer-like keys come first in JSON.stringify's order; a view must keep that order.
  { b: 1, '2': 'two', a: 2, '1': 'one', prompt: [[1, 2], [3]], n: 2 },
  { model: 'm', messages: [{ role: 'user', content: 'hi' }], kv_transfer_params: { remote_host: 'evil' }, vllm_xargs: { kv_transfer_params: {}, keep: 1 } },
  { model: 'm', max_completion_tokens: null, prompt: '' },
  {},
]

t.test('prefill and decode legs: the same bytes as the object functions', async (t) => {
  const params = { remote_engine_id: 'e', remote_block_ids: [[1]], remote_host: 'h', remote_port: 1 }
  for (const body of bodies) {
    const v = root(body)
    t.equal(text(v), JSON.stringify(withoutClientParams(body)), 'the client body, without its params')
    t.equal(text(prefillView(v)), JSON.stringify(prefillBody(body)), `prefill of ${JSON.stringify(body)}`)
    t.equal(text(decodeView(v, params)), JSON.stringify(decodeBody(body, params)), 'decode with params')
    t.equal(text(decodeView(v, undefined)), JSON.stringify(decodeBody(body, undefined)), 'decode without params')
    t.same(prefillView(v).toObject(), prefillBody(body), 'toObject is the object')
  }
})

t.test('sub-requests of a batch and of n > 1: the bytes of the copies they replace', async (t) => {
  for (const body of bodies) {
    const subs = splitRequest(body, '/v1/completions', root(body)) ?? []
    const prompts = Array.isArray(body.prompt) && !body.prompt.every((p) => typeof p === 'number') ? body.prompt : [body.prompt]
    const n = typeof body.n === 'number' && body.n > 1 ? body.n : 1
    for (const s of subs) {
      const copy: Record<string, unknown> = { ...withoutClientParams(body) }
      if (prompts.length > 1 || Array.isArray(body.prompt)) copy.prompt = prompts[s.prompt]
      if (n > 1) copy.n = 1
      if (n > 1 && typeof body.seed === 'number') copy.seed = body.seed + s.choice
      t.equal(text(s.view), JSON.stringify(copy))
      t.equal(text(prefillView(s.view)), JSON.stringify(prefillBody(copy)))
      t.equal(text(decodeView(s.view, { x: s.index })), JSON.stringify(decodeBody(copy, { x: s.index })))
    }
  }
})

t.test('any other change is still exact, member by member', async (t) => {
  const v = new SharedBody({ a: 1, b: { c: 2 }, d: 'x', e: [1] }, ['d']).view()
  t.equal(text(v.without(['b'])), JSON.stringify({ a: 1, d: 'x', e: [1] }))
  t.equal(text(v.with({ a: 5, z: true })), JSON.stringify({ a: 5, b: { c: 2 }, d: 'x', e: [1], z: true }))
  t.equal(text(v.without(['a']).with({ a: 0 })), JSON.stringify({ b: { c: 2 }, d: 'x', e: [1], a: 0 }), 'dropped then set: appended, as on an object')
  t.equal(text(v.with({ z: 1 }).without(['z'])), JSON.stringify({ a: 1, b: { c: 2 }, d: 'x', e: [1] }))
  t.equal(text(v.with({ u: undefined })), JSON.stringify({ a: 1, b: { c: 2 }, d: 'x', e: [1] }), 'undefined members are left out')
  t.equal(v.with({ z: 1 }).get('z'), 1)
  t.equal(v.without(['a']).get('a'), undefined)
  t.equal(v.payload().bytes, Buffer.byteLength(JSON.stringify({ a: 1, b: { c: 2 }, d: 'x', e: [1] })))
})

t.test("a large member is serialised once: every leg's payload holds the same Buffer", async (t) => {
  const big = 'x'.repeat(1 << 20)
  const body = { model: 'm', prompt: ['p0', 'p1', 'p2'], n: 2, pass: big }
  const subs = splitRequest(body, '/v1/completions', root(body)) ?? []
  t.equal(subs.length, 6)
  const legs = subs.flatMap((s) => [prefillView(s.view).payload(), decodeView(s.view, { k: 1 }).payload()])
  const bigChunks = legs.map((p) => p.chunks.find((c) => c.length > big.length))
  t.ok(bigChunks.every((c) => c !== undefined && c === bigChunks[0]), 'one Buffer shared by 12 legs')
  t.ok(legs.every((p) => p.bytes > big.length))
})
