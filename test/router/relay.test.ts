import { Readable } from 'node:stream'
import t from 'tap'
import { frameEnd, hasErrorEvent, isRolePreamble, relaySse } from '../../router/src/proxy/relay.js'

t.test('frameEnd: the end of the last whole frame, LF or CRLF', async (t) => {
  t.equal(frameEnd(Buffer.from('data: a\n\ndata: b')), 9)
  t.equal(frameEnd(Buffer.from('data: a\r\n\r\n')), 11)
  t.equal(frameEnd(Buffer.from('data: a')), 0, 'no whole frame yet')
})

t.test("hasErrorEvent: an engine's own error event, and nothing that merely mentions one", async (t) => {
  t.ok(hasErrorEvent(Buffer.from('data: {"error": {"message": "KV load failed", "code": 500}}\n\n')), "vLLM's shape")
  t.ok(hasErrorEvent(Buffer.from('data:{"error":{"message":"x"}}\n\n')), 'without spaces')
  t.ok(hasErrorEvent(Buffer.from('data: {"id":"c","choices":[]}\n\ndata: {"error":{"message":"x"}}\n\n')), 'after another frame')
  t.notOk(hasErrorEvent(Buffer.from('data: {"id":"c","choices":[{"text":"the \\"error\\": word"}]}\n\n')), 'in generated text')
  t.notOk(hasErrorEvent(Buffer.from('data: {"id":"c","choices":[{"text":"\\ndata: {\\"error\\":1}"}]}\n\n')), 'a line start inside JSON text')
  t.notOk(hasErrorEvent(Buffer.from('data: [DONE]\n\n')))
})

async function relayed(chunks: string[]): Promise<{ out: string; first: string[]; end: unknown[] }> {
  const first: string[] = []
  const end: unknown[] = []
  const body = Readable.from(chunks.map((c) => Buffer.from(c))) as unknown as Parameters<typeof relaySse>[0]
  const stream = relaySse(body, {
    signal: new AbortController().signal,
    onFirstFrame: (kind) => {
      first.push(kind)
      return undefined
    },
    onEnd: (r) => end.push(r),
    mapError: () => {
      throw new Error('no transport failure in these cases')
    },
  })
  let out = ''
  for await (const c of stream) out += (c as Buffer).toString()
  return { out, first, end }
}

t.test('relaySse: the first frame and the end tell an engine error event from data', async (t) => {
  const error = 'data: {"error":{"message":"KV load failed","code":"SIM_ERR_KV_LOAD_FAILED"}}\n\n'
  const token = 'data: {"id":"c","choices":[{"index":0,"text":"hi"}]}\n\n'
  let r = await relayed([error, 'data: [DONE]\n\n'])
  t.same([r.first, r.end], [['error'], ['error_event']], 'a failed load: error first, and the stream carried one')
  t.equal(r.out, `${error}data: [DONE]\n\n`, 'passed on as it came')
  r = await relayed([token + error, 'data: [DONE]\n\n'])
  t.same([r.first, r.end], [['data'], ['error_event']], 'an error after tokens, in the same chunk: the first frame was data')
  r = await relayed([token.slice(0, 10), token.slice(10), 'data: [DONE]\n\n'])
  t.same([r.first, r.end], [['data'], ['ok']], 'a frame split over chunks is judged once whole')
})

t.test("relaySse: a chat stream's role preamble is not the verdict (vLLM 0.32 sends it before a failed load's error event)", async (t) => {
  const role = 'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}\n\n'
  const error = 'data: {"error":{"message":"KV load failed","code":"SIM_ERR_KV_LOAD_FAILED"}}\n\n'
  const content = 'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":null}]}\n\n'
  let r = await relayed([role, error, 'data: [DONE]\n\n'])
  t.same(r.first, ['error'], 'preamble, then the error event: error')
  r = await relayed([role + error + 'data: [DONE]\n\n'])
  t.same(r.first, ['error'], 'all in one chunk: error')
  r = await relayed([role, content, 'data: [DONE]\n\n'])
  t.same(r.first, ['data'], 'preamble, then content: data')
  r = await relayed([role])
  t.same(r.first, ['data'], 'a stream that ends after its preamble is judged once, at its end')
  t.notOk(isRolePreamble({ choices: [{ delta: { role: 'assistant', content: 'x' } }] }), 'a role with content is content')
  t.notOk(isRolePreamble({ choices: [{ delta: { role: 'assistant' }, finish_reason: 'stop' }] }), 'a finish is telling')
  t.notOk(isRolePreamble({ choices: [] }), 'a usage chunk is telling')
})
