import { Ajv } from 'ajv'
import t from 'tap'
import { createAjv } from '../../schemas/ajv.js'
import { staleSchemaFiles } from '../../schemas/generate.js'
import { schemaId, sharedSchemas } from '../../schemas/index.js'
import { isCompleteHandoff } from '../../schemas/kv-transfer-params.js'

t.test('schemas/json matches the TypeBox sources (run `npm run schemas` after a change)', async (t) => {
  t.same(staleSchemaFiles(), [])
})

t.test('every shared schema compiles in strict mode and has a unique $id', async (t) => {
  const ids = sharedSchemas.map(schemaId)
  t.equal(new Set(ids).size, ids.length)
  const ajv = createAjv()
  for (const id of ids) t.ok(ajv.getSchema(id), id)
  t.type(ajv, Ajv)
})

t.test('a vLLM prefill answer validates, and a complete handoff is recognised', async (t) => {
  const ajv = createAjv()
  const params = {
    do_remote_prefill: true,
    do_remote_decode: false,
    remote_block_ids: [[1, 2, 3], [7]],
    remote_engine_id: 'e-1',
    remote_request_id: 'cmpl-x-0-abcdefgh',
    remote_host: '10.0.0.1',
    remote_port: 5600,
    tp_size: 1,
    remote_blocks_expiry_time: null,
    transfer_mode: 'pull',
    something_newer: 1,
  }
  t.ok(ajv.validate('KvTransferParams', params), 'unknown fields are allowed')
  t.ok(isCompleteHandoff(params))
  t.notOk(isCompleteHandoff({ ...params, remote_block_ids: [] }), 'no blocks, no handoff')
  t.notOk(isCompleteHandoff({ ...params, remote_host: null }))
  t.notOk(isCompleteHandoff(null))
  t.notOk(ajv.validate('KvTransferParams', { ...params, remote_port: 'x' }))
})

t.test('vLLM 0.32 (connector v14): its prefill answer, as one gave it in test/vllm/, validates and is a complete handoff', async (t) => {
  const ajv = createAjv()
  // Taken from a real vLLM 0.32.0 CPU prefiller (NixlConnector, kv_producer).
  const params = {
    do_remote_prefill: true,
    do_remote_decode: false,
    remote_block_ids: [[1]],
    remote_engine_id: '4ac50efc-8576-41e4-9f63-7b2d5161e2ea',
    remote_request_id: 'cmpl-9f6bf4d01c609131-0-ac0fbe0f',
    remote_host: '127.0.0.1',
    remote_port: 18200,
    tp_size: 1,
    dcp_size: 1,
    pp_size: 1,
    remote_num_tokens: 16,
    remote_blocks_expiry_time: null,
    transfer_mode: 'pull',
    remote_prefill_cached_tokens: 0,
  }
  t.ok(ajv.validate('KvTransferParams', params), JSON.stringify(ajv.errors))
  t.ok(isCompleteHandoff(params))
  t.notOk(ajv.validate('KvTransferParams', { ...params, remote_prefill_cached_tokens: -1 }), 'a negative cache count is refused')
})
