import { Writable } from 'node:stream'
import t from 'tap'
import { parseSimArgs, usage } from '../../sim/src/config.js'
import { oracleMain } from '../../sim/src/oracle-cli.js'
import { oracleOutput, oracleText } from '../../sim/src/oracle.js'

function capture(): { out: Writable; text: () => string } {
  let buf = ''
  const out = new Writable({
    write(chunk: Buffer, _enc, cb) {
      buf += chunk.toString()
      cb()
    },
  })
  return { out, text: () => buf }
}

t.test('flags map onto SimConfig', async (t) => {
  const c = parseSimArgs([
    '--role', 'decode', '--port', '8100', '--engine-id', 'e1', '--lease-seconds', '5', '--bytes-per-token', '64',
    '--error-rate', '0.5', '--stall-ms', '10', '--crash-after', '3', '--unhealthy', '--seed', '9',
  ])
  t.not(c, 'help')
  if (c === 'help') return
  t.match(c, { role: 'decode', port: 8100, engineId: 'e1', leaseSeconds: 5, bytesPerToken: 64, seed: 9, kv: 'none' })
  t.match(c.faults, { errorRate: 0.5, stallMs: 10, crashAfter: 3, unhealthy: true, garbageRate: 0 })
  t.equal(parseSimArgs(['--help']), 'help')
  t.throws(() => parseSimArgs(['--port', 'abc']), { code: 'SIM_ERR_INVALID_CONFIG', message: /--port must be integer/ })
  t.throws(() => parseSimArgs(['--role', 'x']), { message: /--role/ })
  t.throws(() => parseSimArgs(['--nope']), { code: 'SIM_ERR_INVALID_CONFIG', message: /Unknown option/ })
  t.throws(() => parseSimArgs(['extra']), { code: 'SIM_ERR_INVALID_CONFIG' })
  const u = usage()
  for (const flag of ['--role', '--kv', '--block-size', '--num-gpu-blocks-override', '--max-model-len', '--default-max-tokens', '--prefill-delay-ms',
    '--decode-delay-ms', '--side-channel-host', '--side-channel-port', '--error-rate', '--stall-rate', '--stall-ms', '--crash-after',
    '--garbage-rate', '--disconnect-rate', '--kv-load-failure-rate', '--unhealthy', '--seed', '--log-level', '--body-limit']) {
    t.match(u, flag)
  }
})

t.test('--kv agent flags: --agent-url is required, the failure policy is fail or recompute', async (t) => {
  const c = parseSimArgs(['--kv', 'agent', '--agent-url', 'http://127.0.0.1:7300', '--agent-token', 'tok', '--shm-name', '/kv-1', '--kv-load-failure-policy', 'recompute'])
  t.match(c, { kv: 'agent', agentUrl: 'http://127.0.0.1:7300', agentToken: 'tok', shmName: '/kv-1', kvLoadFailurePolicy: 'recompute' })
  t.match(parseSimArgs(['--kv', 'agent', '--agent-url', 'http://127.0.0.1:7300']), { kvLoadFailurePolicy: 'fail' }, "vLLM's default")
  t.match(parseSimArgs([]), { kv: 'none', kvLoadFailurePolicy: 'fail' })
  t.throws(() => parseSimArgs(['--kv', 'agent']), { code: 'SIM_ERR_INVALID_CONFIG', message: /--agent-url is required with --kv agent/ })
  t.throws(() => parseSimArgs(['--kv-load-failure-policy', 'retry']), { code: 'SIM_ERR_INVALID_CONFIG', message: /--kv-load-failure-policy/ })
  t.throws(() => parseSimArgs(['--agent-url', 'ftp://x']), { code: 'SIM_ERR_INVALID_CONFIG', message: /--agent-url/ })
  t.throws(() => parseSimArgs(['--agent-url', 'http://x/v1']), { code: 'SIM_ERR_INVALID_CONFIG', message: /--agent-url/ }, 'an origin, no path')
  t.throws(() => parseSimArgs(['--shm-name', 'no-slash']), { code: 'SIM_ERR_INVALID_CONFIG', message: /--shm-name/ })
  for (const flag of ['--agent-url', '--agent-token', '--shm-name', '--kv-load-failure-policy']) t.match(usage(), flag)
})

t.test('oracle CLI in process', async (t) => {
  const a = capture()
  await oracleMain(['--max-tokens', '3', '--prompt', 'Hi there'], a.out)
  t.equal(a.text(), oracleText({ kind: 'completion', prompt: 'Hi there', maxTokens: 3 }))
  const h = capture()
  await oracleMain(['--help'], h.out)
  t.match(h.text(), /no trailing newline/)
  const d = capture()
  await oracleMain(['--prompt', 'x'], d.out)
  t.equal(d.text().split(' ').length - 1, 16, 'default 16 tokens')

  // Stop options: the same answer as the oracle library with the same criteria.
  const plain = oracleOutput({ kind: 'completion', prompt: 'Hi there', maxTokens: 6 })
  const word = (plain.pieces[2] as string).trim()
  const cases: [string[], Parameters<typeof oracleText>[0], number | undefined][] = [
    [['--stop', 'nope', '--stop', word], { kind: 'completion', prompt: 'Hi there', maxTokens: 6, stop: ['nope', word] }, undefined],
    [['--stop-token-ids', `${plain.tokens[1]},999`], { kind: 'completion', prompt: 'Hi there', maxTokens: 6, stopTokenIds: [plain.tokens[1] as number, 999] }, undefined],
    [['--eos-after-tokens', '2'], { kind: 'completion', prompt: 'Hi there', maxTokens: 6 }, 2],
    [['--eos-after-tokens', '2', '--ignore-eos'], { kind: 'completion', prompt: 'Hi there', maxTokens: 6, ignoreEos: true }, 2],
    [['--eos-after-tokens', '2', '--min-tokens', '3'], { kind: 'completion', prompt: 'Hi there', maxTokens: 6, minTokens: 3 }, 2],
  ]
  for (const [args, input, eos] of cases) {
    const c = capture()
    await oracleMain(['--max-tokens', '6', '--prompt', 'Hi there', ...args], c.out)
    t.equal(c.text(), oracleText(input, { eosAfterTokens: eos }), args.join(' '))
  }
  t.not(oracleText(cases[0]![1]), plain.text, 'the stop string changed the text')

  const saved = process.exitCode
  const write = process.stderr.write.bind(process.stderr)
  const errors: string[] = []
  process.stderr.write = ((s: string) => errors.push(String(s)) > 0) as typeof process.stderr.write
  try {
    for (const args of [['--max-tokens', '0', '--prompt', 'a'], ['--prompt', 'a', '--messages', '[]'], ['--messages', '[1]'], ['--messages', '{bad'], ['--prompt', 'a', '--stop-token-ids', 'x'], ['--prompt', 'a', '--min-tokens', '-1']]) {
      process.exitCode = 0
      await oracleMain(args, capture().out)
      t.equal(process.exitCode, 2, args.join(' '))
    }
  } finally {
    process.stderr.write = write
    process.exitCode = saved
  }
  t.match(errors.join(''), /--max-tokens must be a positive integer/)
})
