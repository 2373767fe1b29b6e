import t from 'tap'
import { decodeBody, prefillBody, wantsStream } from '../../router/src/proxy/legs.js'

t.test('the prefill leg: do_remote_decode, not streamed, one token, forced to finish by length, unsupported options removed', async (t) => {
  const body = {
    model: 'm',
    messages: [{ role: 'user', content: 'hi' }],
    stream: true,
    stream_options: { include_usage: true },
    max_tokens: 50,
    max_completion_tokens: 40,
    min_tokens: 3,
    min_completion_tokens: 2,
    temperature: 0.3,
    stop: ['\n'],
    stop_token_ids: [7],
    n: 3,
    best_of: 3,
    ignore_eos: false,
  }
  const p = prefillBody(body)
  t.same(p, {
    model: 'm',
    messages: [{ role: 'user', content: 'hi' }],
    stream: false,
    max_tokens: 1,
    max_completion_tokens: 1,
    temperature: 0.3,
    ignore_eos: true,
    n: 1,
    kv_transfer_params: {
      do_remote_decode: true,
      do_remote_prefill: false,
      remote_engine_id: null,
      remote_block_ids: null,
      remote_host: null,
      remote_port: null,
    },
  })
  t.equal(body.max_tokens, 50, 'the original body is not modified')
  t.notOk('max_completion_tokens' in prefillBody({ model: 'm', prompt: 'x' }), 'max_completion_tokens only when the client sent it')
})

t.test('the decode leg: the original body plus P params verbatim', async (t) => {
  const params = { remote_engine_id: 'e', remote_block_ids: [[1, 2]], future_field: { nested: true } }
  const body = { model: 'm', prompt: 'x', stream: true, min_tokens: 2 }
  const d = decodeBody(body, params)
  t.same(d, { ...body, kv_transfer_params: params })
  t.equal(d.kv_transfer_params, params, 'the same object: never rebuilt field by field')
  t.equal(decodeBody(body, undefined), body, 'without params the body is unchanged')
  t.same(decodeBody({ ...body, kv_transfer_params: { x: 1 } }, undefined), body, "a client's own params are dropped")
  t.ok(wantsStream(body))
  t.notOk(wantsStream({ stream: 'yes' }))
})

t.test("a client's kv_transfer_params inside vllm_xargs reaches neither leg (issue 18 item 4)", async (t) => {
  // vLLM copies vllm_xargs into SamplingParams.extra_args, where its connector reads
  // kv_transfer_params: a client could name any remote host for D to read from.
  const forged = { do_remote_prefill: true, remote_host: '10.0.0.9', remote_port: 1, remote_engine_id: 'x', remote_block_ids: [[1]] }
  const body = { model: 'm', prompt: 'x', kv_transfer_params: forged, vllm_xargs: { kv_transfer_params: forged, my_arg: 3 } }
  const p = prefillBody(body)
  t.same(p.vllm_xargs, { my_arg: 3 }, 'prefill leg: stripped, other extra args kept')
  t.same((p.kv_transfer_params as Record<string, unknown>).remote_host, null, "prefill leg: the router's own params")
  t.same(decodeBody(body, undefined), { model: 'm', prompt: 'x', vllm_xargs: { my_arg: 3 } }, 'decode leg without P params')
  const params = { remote_engine_id: 'e' }
  t.same(decodeBody(body, params), { model: 'm', prompt: 'x', kv_transfer_params: params, vllm_xargs: { my_arg: 3 } }, "decode leg: P's params only")
  t.same(body.vllm_xargs, { kv_transfer_params: forged, my_arg: 3 }, 'the client body is not modified')
  const plain = { model: 'm', prompt: 'x', vllm_xargs: { my_arg: 3 } }
  t.equal(decodeBody(plain, undefined), plain, 'nothing to strip: the same body')
})
