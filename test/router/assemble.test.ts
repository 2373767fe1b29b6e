import t from 'tap'
import { readFileSync } from 'node:fs'
import { Readable } from 'node:stream'
import { assembleStream, StreamedError } from '../../router/src/proxy/assemble.js'

/*
 * A non-streamed answer assembled from D's stream (leases.readCheck router) must be the one
 * vLLM gives whole. The fixture is vLLM 0.32's own output for the same greedy requests, once
 * whole and once streamed with include_usage (recorded from the real engine of test/vllm/):
 * completions with echo and logprobs, with token ids and a stop, chat plain and with
 * top_logprobs.
 */
const fixture = JSON.parse(readFileSync(new URL('../fixtures/vllm-0.32-answers.json', import.meta.url), 'utf8')) as Record<string, string>

type Body = Record<string, unknown>
const chunks = (text: string, size: number): AsyncIterable<Buffer> => {
  const buf = Buffer.from(text)
  const parts: Buffer[] = []
  for (let i = 0; i < buf.length; i += size) parts.push(buf.subarray(i, i + size))
  return Readable.from(parts)
}

/** What a client reads of an answer: not the ids and times of two different requests. */
function essence(a: Body): Body {
  const usage = a.usage as Body
  return {
    object: a.object,
    model: a.model,
    system_fingerprint: a.system_fingerprint,
    usage: { prompt_tokens: usage.prompt_tokens, completion_tokens: usage.completion_tokens, total_tokens: usage.total_tokens },
    choices: (a.choices as Body[]).map((c) => {
      const { prompt_logprobs: _p, routed_experts: _r, ...rest } = c
      const message = rest.message as Body | undefined
      if (!message) return rest
      return { ...rest, message: { role: message.role, content: message.content, reasoning: message.reasoning } }
    }),
  }
}

for (const [name, chat] of [
  ['cLp', false],
  ['cTok', false],
  ['h', true],
  ['hLp', true],
] as const) {
  t.test(`${name}: assembled from vLLM's stream = vLLM's whole answer`, async (t) => {
    const whole = JSON.parse(fixture[`${name}Json`] as string) as Body
    // Frames cut at odd places, as TCP delivers them.
    for (const size of [7, 100, 1 << 20]) {
      let first: string | undefined
      const assembled = await assembleStream(chunks(fixture[`${name}Sse`] as string, size), chat, (kind) => {
        first ??= kind
        return undefined
      })
      t.same(essence(assembled), essence(whole), `cut every ${size} bytes`)
      t.equal(first, 'data', 'the first telling frame was data')
    }
  })
}

t.test('the first telling frame comes past a chat role preamble, and may stop the assembly', async (t) => {
  let calls = 0
  const stop = new Error('late')
  const sse = fixture.hSse as string
  await t.rejects(
    assembleStream(chunks(sse, 50), true, () => {
      calls++
      return stop
    }),
    stop,
  )
  t.equal(calls, 1)
})

t.test("D's error event ends the assembly with StreamedError", async (t) => {
  const sse = 'data: {"id":"x","object":"text_completion","choices":[]}\n\ndata: {"error":{"message":"KV load failed","code":500}}\n\ndata: [DONE]\n\n'
  let first: string | undefined
  const err = await assembleStream(chunks(sse, 16), false, (kind) => {
    first = kind
    return undefined
  }).catch((e: unknown) => e)
  t.ok(err instanceof StreamedError)
  t.match((err as StreamedError).event, /KV load failed/)
  t.equal(first, 'data', 'a frame before it already judged the read (an empty-choices frame counts as data)')
})

t.test('tool calls streamed in pieces are put together by index', async (t) => {
  const frame = (delta: Body, finish: string | null = null) => `data: ${JSON.stringify({ id: 'c', object: 'chat.completion.chunk', created: 1, model: 'm', choices: [{ index: 0, delta, logprobs: null, finish_reason: finish }] })}\n\n`
  const sse =
    frame({ role: 'assistant', content: '' }) +
    frame({ tool_calls: [{ index: 0, id: 'call_1', type: 'function', function: { name: 'get_weather', arguments: '' } }] }) +
    frame({ tool_calls: [{ index: 0, function: { arguments: '{"city": ' } }] }) +
    frame({ tool_calls: [{ index: 0, function: { arguments: '"Paris"}' } }] }) +
    frame({ reasoning: 'thinking' }, 'tool_calls') +
    'data: [DONE]\n\n'
  const a = await assembleStream(chunks(sse, 33), true, () => undefined)
  t.same((a.choices as Body[])[0], {
    index: 0,
    message: { role: 'assistant', content: '', refusal: null, reasoning: 'thinking', tool_calls: [{ id: 'call_1', type: 'function', function: { name: 'get_weather', arguments: '{"city": "Paris"}' } }] },
    logprobs: null,
    finish_reason: 'tool_calls',
    stop_reason: null,
    token_ids: null,
  })
  t.equal(a.object, 'chat.completion')
})
