import { spawnSync } from 'node:child_process'
import t from 'tap'
import { cliEntry } from '../../common/paths.js'
import { spawnService } from '../../common/spawn.js'
import { oracleText } from '../../sim/src/oracle.js'

/*
 * The real `handoff sim` process over loopback (needs `npm run build`): flags, readiness,
 * a P leg and a D leg between two processes, the oracle CLI, bad flags, SIGTERM.
 */

const MODEL = 'handoff/sim-1'

t.test('two sim processes serve a P/D request with the oracle text', async (t) => {
  const p = await spawnService({ args: ['sim', '--role', 'prefill', '--port', '0', '--engine-id', 'p-1', '--seed', '1'], readyTimeoutMs: 15000 })
  t.teardown(() => p.stop())
  const d = await spawnService({ args: ['sim', '--role', 'decode', '--port', '0', '--decode-delay-ms', '1'], readyTimeoutMs: 15000 })
  t.teardown(() => d.stop())
  const post = async (url: string, body: object, rid: string): Promise<Response> =>
    fetch(`${url}/v1/chat/completions`, {
      method: 'POST',
      headers: { 'content-type': 'application/json', 'x-request-id': rid },
      body: JSON.stringify(body),
      signal: AbortSignal.timeout(10000),
    })
  const messages = [{ role: 'user', content: 'Across two processes' }]
  const pr = (await (await post(p.url, { model: MODEL, messages, max_tokens: 1, stream: false, kv_transfer_params: { do_remote_decode: true } }, 'x1')).json()) as {
    kv_transfer_params: Record<string, unknown>
  }
  t.equal(pr.kv_transfer_params.remote_engine_id, 'p-1')
  const dr = await post(d.url, { model: MODEL, messages, max_tokens: 5, stream: true, kv_transfer_params: pr.kv_transfer_params }, 'x1')
  const text = (await dr.text())
    .split('\n\n')
    .filter((e) => e.startsWith('data: {'))
    .map((e) => (JSON.parse(e.slice(6)) as { choices: { delta?: { content?: string } }[] }).choices[0]?.delta?.content ?? '')
    .join('')
  t.equal(text, oracleText({ kind: 'chat', messages, maxTokens: 5 }))
  const health = await fetch(`${d.url}/health`)
  t.equal(health.status, 200)
  t.match(d.output(), /"reqId":"x1"/, 'JSON logs carry the request id')
  t.equal(await d.stop(), 0, 'SIGTERM exits cleanly')
})

t.test('vLLM-imitation flags on a real process: --api-key, --eos-after-tokens, --vllm-compat legacy, --keep-alive-ms', async (t) => {
  const sim = await spawnService({
    args: ['sim', '--port', '0', '--api-key', 'k1', '--eos-after-tokens', '1', '--vllm-compat', 'legacy', '--keep-alive-ms', '1000', '--log-level', 'warn'],
    readyTimeoutMs: 15000,
  })
  t.teardown(() => sim.stop())
  const auth = { authorization: 'Bearer k1' }
  t.equal((await fetch(`${sim.url}/v1/models`, { signal: AbortSignal.timeout(10000) })).status, 401)
  t.equal((await fetch(`${sim.url}/v1/models`, { headers: auth, signal: AbortSignal.timeout(10000) })).status, 200)
  t.equal((await fetch(`${sim.url}/health`, { signal: AbortSignal.timeout(10000) })).status, 200)
  const leg = async (rid: string, extra: object): Promise<{ choices: { finish_reason: string }[]; kv_transfer_params: Record<string, unknown> | null }> => {
    const r = await fetch(`${sim.url}/v1/completions`, {
      method: 'POST',
      headers: { ...auth, 'content-type': 'application/json', 'x-request-id': rid },
      body: JSON.stringify({ model: MODEL, prompt: 'flags on a process', max_tokens: 1, stream: false, kv_transfer_params: { do_remote_decode: true }, ...extra }),
      signal: AbortSignal.timeout(10000),
    })
    return (await r.json()) as { choices: { finish_reason: string }[]; kv_transfer_params: Record<string, unknown> | null }
  }
  const stopped = await leg('p-eos', {})
  t.same([stopped.choices[0]?.finish_reason, stopped.kv_transfer_params], ['stop', null], 'EOS as P\'s token: no params')
  const forced = await leg('p-len', { ignore_eos: true })
  t.equal(forced.choices[0]?.finish_reason, 'length')
  t.notOk(forced.kv_transfer_params && 'remote_request_id' in forced.kv_transfer_params, 'legacy shape')
  t.ok(Array.isArray(forced.kv_transfer_params?.remote_block_ids) && (forced.kv_transfer_params.remote_block_ids as unknown[]).every(Number.isInteger), 'flat block ids')
  const log = (await (await fetch(`${sim.url}/sim/requests`, { signal: AbortSignal.timeout(10000) })).json()) as { requests: Record<string, unknown>[] }
  t.match(log.requests.slice(-2), [
    { xRequestId: 'p-eos', finishReason: 'stop', kvTransferParams: null },
    { xRequestId: 'p-len', finishReason: 'length', kvTransferParams: { remote_engine_id: String } },
  ])
})

t.test('oracle CLI prints exactly the text', async (t) => {
  const run = (args: string[]) => spawnSync(process.execPath, [cliEntry, 'sim', 'oracle', ...args], { encoding: 'utf8', timeout: 30000 })
  const c = run(['--max-tokens', '4', '--prompt', 'Hello'])
  t.equal(c.status, 0)
  t.equal(c.stdout, oracleText({ kind: 'completion', prompt: 'Hello', maxTokens: 4 }), 'no trailing newline')
  const messages = [{ role: 'user', content: 'Hi' }]
  const m = run(['--max-tokens', '3', '--messages', JSON.stringify(messages), '--model', 'ignored'])
  t.equal(m.stdout, oracleText({ kind: 'chat', messages, maxTokens: 3 }))
})

t.test('bad flags exit 2 with a clear message', async (t) => {
  const run = (args: string[]) => spawnSync(process.execPath, [cliEntry, 'sim', ...args], { encoding: 'utf8', timeout: 30000 })
  const bad = run(['--error-rate', '3'])
  t.equal(bad.status, 2)
  t.match(bad.stderr, /SIM_ERR_INVALID_CONFIG: .*--error-rate must be <= 1/)
  const agent = run(['--kv', 'agent'])
  t.equal(agent.status, 2)
  t.match(agent.stderr, /SIM_ERR_INVALID_CONFIG: .*--agent-url is required with --kv agent/)
})
