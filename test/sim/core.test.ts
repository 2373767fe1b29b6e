import t from 'tap'
import { seededRandom } from '../../common/random.js'
import { BlockPool } from '../../sim/src/block-pool.js'
import { renderChat } from '../../sim/src/chat-template.js'
import { validateSimConfig } from '../../sim/src/config.js'
import { FaultState } from '../../sim/src/faults.js'
import { detokenize, generateTokens, kvDigest, WORDS } from '../../sim/src/generator.js'
import { writePromptKv } from '../../sim/src/kv-bytes.js'
import { KvRegion } from '../../sim/src/kv-region.js'
import { parseRemoteKv } from '../../sim/src/kv-source.js'
import { oracleForBody, oracleText, oracleTokensFor } from '../../sim/src/oracle.js'
import { preparePrompt, resolveMaxTokens } from '../../sim/src/prompt.js'
import { pieces, tokenize, tokenizeReference, VOCAB_SIZE } from '../../sim/src/tokenizer.js'

const bigPrompt = (bytes: number): string => {
  const words = ['the', 'quick', 'brown', 'fox,', 'jumps', 'over', 'the', 'lazy', 'dog.', '\n', 'Ünïcode', '  x']
  const parts: string[] = []
  let len = 0
  for (let i = 0; len < bytes; i++) {
    const w = words[(i * 7) % words.length] as string
    parts.push(w)
    len += w.length + 1
  }
  return parts.join(' ')
}

t.test('tokenizer', async (t) => {
  t.same(pieces('Hello, world!  ok\n'), ['Hello', ',', ' world', '!', '  ', 'ok', '\n'])
  const ids = tokenize('Hello, world!')
  t.same([...ids], [...tokenize('Hello, world!')], 'deterministic')
  t.ok([...ids].every((id) => id < VOCAB_SIZE))
  t.equal(tokenize('').length, 0)
  // The scanner must split exactly like the reference regex, on awkward input too.
  const rnd = seededRandom(7)
  const alphabet = ['a', 'Z', '9', ' ', '  ', '\t', '\n', '.', ',', '!', '`', '{', 'é', '\u00a0', '\u3000', '😀', '_', '~']
  for (let n = 0; n < 200; n++) {
    let s = ''
    for (let i = 0; i < 40; i++) s += alphabet[Math.floor(rnd.next() * alphabet.length)]
    t.same([...tokenize(s)], [...tokenizeReference(s)], `agrees on ${JSON.stringify(s)}`)
  }
  const prompt = bigPrompt(200 * 1024)
  t.same([...tokenize(prompt)], [...tokenizeReference(prompt)])
  // Linear, not quadratic: one 200 KiB prompt costs about what ten 20 KiB ones do (a
  // quadratic tokenizer would take 10x as long). Measured together, so a busy machine slows
  // both; the bound is loose on purpose.
  const small = bigPrompt(20 * 1024)
  const timed = (fn: () => void): number => {
    const t0 = performance.now()
    fn()
    return performance.now() - t0
  }
  timed(() => tokenize(small))
  const tens = Math.min(...[0, 1, 2].map(() => timed(() => {
    for (let i = 0; i < 10; i++) tokenize(small)
  })))
  const whole = Math.min(...[0, 1, 2].map(() => timed(() => tokenize(prompt))))
  t.ok(whole < tens * 4 + 5, `200 KiB tokenizes in linear time (${whole.toFixed(1)} ms; ten 20 KiB prompts: ${tens.toFixed(1)} ms)`)
})

t.test('chat template', async (t) => {
  t.equal(
    renderChat([
      { role: 'system', content: 'Be brief.' },
      { role: 'user', content: [{ type: 'text', text: 'Hi' }, { type: 'image_url', image_url: {} }] },
    ]),
    '<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n',
  )
  t.equal(renderChat([{ role: 'assistant', content: null }], { addGenerationPrompt: false }), '<|im_start|>assistant\n<|im_end|>\n')
})

t.test('KV region and bytes', async (t) => {
  t.throws(() => KvRegion.allocate({ blockSize: 4, bytesPerToken: 12, numBlocks: 2 }), RangeError)
  t.throws(() => new KvRegion({ memory: new ArrayBuffer(10), blockSize: 4, bytesPerToken: 8, numBlocks: 2 }), RangeError)
  const region = KvRegion.allocate({ blockSize: 4, bytesPerToken: 16, numBlocks: 8 })
  t.equal(region.blocksFor(9), 3)
  t.throws(() => region.offset(8, 0), RangeError)
  const a = tokenize('one two three four five six seven')
  const b = tokenize('one two three four FIVE six seven')
  writePromptKv(region, [0, 1], a)
  writePromptKv(region, [4, 5], b)
  t.same(region.blockView(0), region.blockView(4), 'a shared prefix gives the same bytes')
  t.not(Buffer.compare(region.blockView(1, 3), region.blockView(5, 3)), 0, 'a change at j changes the positions from j on')
  // Position bytes depend on the prefix only: rewriting elsewhere gives identical bytes.
  writePromptKv(region, [7, 6], a)
  t.same(region.blockView(7), region.blockView(0))
  t.throws(() => writePromptKv(region, [0], a), RangeError, 'too few blocks')
  // Caller-provided memory (the shared-memory case) is used in place.
  const mem = new Uint8Array(8 * 4 * 16)
  const shared = new KvRegion({ memory: mem, blockSize: 4, bytesPerToken: 16, numBlocks: 8 })
  writePromptKv(shared, [2, 3], a)
  t.same(mem.subarray(2 * 64, 3 * 64), region.blockView(0))
})

t.test('a read after reuse sees another request\u2019s bytes, so the text changes', async (t) => {
  const region = KvRegion.allocate({ blockSize: 16, bytesPerToken: 64, numBlocks: 4 })
  const alloc = new BlockPool({ numBlocks: 4, blockSize: 16, enableCaching: false, hashSeed: 0 })
  const tokensA = tokenize('the prompt of request A, which P prefilled')
  const tokensB = tokenize('request B arrived after A expired and took its blocks')
  const blocksA = alloc.allocate(region.blocksFor(tokensA.length))
  writePromptKv(region, blocksA, tokensA)
  const good = detokenize(generateTokens(kvDigest(region, blocksA, tokensA.length), 8))
  t.equal(good, detokenize(oracleTokensFor(tokensA, 8, 64)), 'digest over blocks equals the oracle')
  alloc.free(blocksA)
  const blocksB = alloc.allocate(region.blocksFor(tokensB.length))
  t.same(blocksB.slice(0, blocksA.length), blocksA)
  writePromptKv(region, blocksB, tokensB)
  const stale = detokenize(generateTokens(kvDigest(region, blocksA, tokensA.length), 8))
  t.not(stale, good)
})

t.test('generation depends on every KV byte', async (t) => {
  const region = KvRegion.allocate({ blockSize: 16, bytesPerToken: 64, numBlocks: 4 })
  const tokens = tokenize('corrupt one byte and the answer must change')
  writePromptKv(region, [0], tokens)
  const before = detokenize(generateTokens(kvDigest(region, [0], tokens.length), 16))
  const at = region.offset(0, tokens.length - 1) + 63
  region.bytes[at] = (region.bytes[at] as number) ^ 1
  const after = detokenize(generateTokens(kvDigest(region, [0], tokens.length), 16))
  t.not(after, before)
  t.throws(() => kvDigest(region, [0], 17), RangeError)
  t.throws(() => generateTokens(new Uint8Array(8), 1), RangeError)
  t.match(before, /^( [a-z]+){16}$/)
  t.ok(before.split(' ').slice(1).every((w) => WORDS.includes(w)))
})

t.test('oracle', async (t) => {
  const a = oracleText({ kind: 'completion', prompt: 'Hello', maxTokens: 5 })
  t.equal(a, oracleText({ kind: 'completion', prompt: 'Hello', maxTokens: 5 }), 'deterministic')
  t.equal(a.split(' ').length - 1, 5)
  t.equal(oracleText({ kind: 'completion', prompt: 'Hello', maxTokens: 3 }), a.split(' ').slice(0, 4).join(' '), 'shorter output is a prefix')
  t.not(oracleText({ kind: 'completion', prompt: 'Hello!', maxTokens: 5 }), a)
  t.not(oracleText({ kind: 'completion', prompt: 'Hello', maxTokens: 5 }, { bytesPerToken: 64 }), a, 'depends on bytesPerToken')
  t.equal(oracleText({ kind: 'completion', prompt: 'Hello' }).split(' ').length - 1, 16, 'default max tokens 16')
  t.equal(oracleText({ kind: 'completion', prompt: [...tokenize('Hello')], maxTokens: 5 }), a, 'token ids prompt')
  const messages = [{ role: 'user', content: 'Hi' }]
  t.equal(
    oracleForBody('/v1/chat/completions', { messages, max_tokens: 9, max_completion_tokens: 4 }),
    oracleText({ kind: 'chat', messages, maxTokens: 4 }),
    'max_completion_tokens wins',
  )
  t.equal(oracleForBody('/v1/completions', { prompt: 'Hello', max_tokens: 5 }), a)
})

t.test('prompt limits', async (t) => {
  const limits = { defaultMaxTokens: 16, maxModelLen: 10 }
  t.throws(() => preparePrompt({ kind: 'completion', prompt: 'a b c d e f g h i j k' }, limits), { code: 'SIM_ERR_PROMPT_TOO_LONG', statusCode: 400 })
  t.throws(() => preparePrompt({ kind: 'completion', prompt: 'a b', maxTokens: 9 }, limits), { code: 'SIM_ERR_MAX_TOKENS_TOO_LARGE' })
  t.equal(preparePrompt({ kind: 'completion', prompt: 'a b', maxTokens: 8 }, limits).maxTokens, 8)
  t.throws(() => preparePrompt({ kind: 'completion', prompt: ['a', 'b'] }, limits), { code: 'SIM_ERR_UNSUPPORTED_PROMPT' })
  t.same([...preparePrompt({ kind: 'completion', prompt: [[1, 2]], maxTokens: 1 }, limits).tokens], [1, 2])
  t.same([...preparePrompt({ kind: 'completion', prompt: ['a b'], maxTokens: 1 }, limits).tokens], [...tokenize('a b')])
  t.equal(resolveMaxTokens({ kind: 'chat', messages: [], maxTokens: null, maxCompletionTokens: null }, 7), 7)
})

t.test('faults', async (t) => {
  const f = new FaultState({ errorRate: 0, stallRate: 0, stallMs: 10, garbageRate: 0, disconnectRate: 0, kvLoadFailureRate: 0, unhealthy: false, healthDelayMs: 0 })
  const rnd = seededRandom(1)
  t.equal(f.decide(rnd), 'none')
  f.update({ errorRate: 1 })
  t.equal(f.decide(rnd), 'error')
  f.update({ errorRate: 0, garbageRate: 1 })
  t.equal(f.decide(rnd), 'garbage')
  f.update({ garbageRate: 0, stallRate: 1 })
  t.equal(f.decide(rnd), 'stall')
  f.update({ stallRate: 0, disconnectRate: 1 })
  t.equal(f.decide(rnd), 'disconnect')
  f.update({ disconnectRate: 0, crashAfter: 2 })
  t.equal(f.decide(rnd), 'none')
  t.equal(f.decide(rnd), 'crash')
  f.update({ crashAfter: null })
  t.equal(f.current.crashAfter, undefined)
  t.equal(f.decide(rnd), 'none')
})

t.test('remote KV params', async (t) => {
  t.same(parseRemoteKv({ remote_block_ids: [] }), { missing: 'remote_block_ids' })
  t.same(parseRemoteKv({ remote_block_ids: [[1]], remote_engine_id: 'e', remote_request_id: 'r', remote_host: 'h' }), { missing: 'remote_port' })
  t.match(parseRemoteKv({ remote_block_ids: [[1]], remote_engine_id: 'e', remote_request_id: 'r', remote_host: 'h', remote_port: 1, tp_size: 1 }), {
    remoteEngineId: 'e',
    remotePort: 1,
    remoteBlocksExpiryTime: null,
  })
})

t.test('config validation', async (t) => {
  const c = validateSimConfig({})
  t.equal(c.role, 'both')
  t.equal(c.faults.errorRate, 0)
  t.ok(Object.isFrozen(c) && Object.isFrozen(c.faults))
  t.throws(() => validateSimConfig({ bytesPerToken: 12 }), { code: 'SIM_ERR_INVALID_CONFIG', message: /bytesPerToken/ })
  t.throws(() => validateSimConfig({ nope: 1 }), { code: 'SIM_ERR_INVALID_CONFIG' })
})
