import { parseArgs } from 'node:util'
import type { ChatMessage } from '../../schemas/openai.js'
import { ORACLE_DEFAULTS, oracleText, type OracleInput } from './oracle.js'

const USAGE = `usage: handoff sim oracle --max-tokens N (--prompt TEXT | --messages JSON) [--bytes-per-token N] [--model ID]
         [--stop TEXT]... [--stop-token-ids ID,ID...] [--ignore-eos] [--min-tokens N] [--eos-after-tokens N]

Prints exactly the text a correct cluster returns (the completion's text, or the chat
answer's content), with no trailing newline. --model is accepted and ignored: the text does
not depend on it. --bytes-per-token must match the simulators' (default ${ORACLE_DEFAULTS.bytesPerToken}).
The stop options are the request's stop, stop_token_ids, ignore_eos and min_tokens;
--eos-after-tokens is the simulators' EOS fault (docs/sim.md "Stop criteria").
`

function positiveInt(name: string, v: string | undefined, fallback: number, min = 1): number {
  if (v === undefined) return fallback
  const n = Number(v)
  if (!Number.isInteger(n) || n < min) throw new Error(`--${name} must be ${min === 1 ? 'a positive' : 'a non-negative'} integer, got '${v}'`)
  return n
}

/** `handoff sim oracle`; exit code 2 on bad usage. */
export async function oracleMain(argv: readonly string[], out: NodeJS.WritableStream = process.stdout): Promise<void> {
  let input: OracleInput
  let bytesPerToken: number
  let eosAfterTokens: number | undefined
  try {
    const { values } = parseArgs({
      args: [...argv],
      options: {
        'max-tokens': { type: 'string' },
        prompt: { type: 'string' },
        messages: { type: 'string' },
        model: { type: 'string' },
        'bytes-per-token': { type: 'string' },
        stop: { type: 'string', multiple: true },
        'stop-token-ids': { type: 'string' },
        'ignore-eos': { type: 'boolean' },
        'min-tokens': { type: 'string' },
        'eos-after-tokens': { type: 'string' },
        help: { type: 'boolean' },
      },
      strict: true,
      allowPositionals: false,
    })
    if (values.help) {
      out.write(USAGE)
      return
    }
    const maxTokens = positiveInt('max-tokens', values['max-tokens'], ORACLE_DEFAULTS.defaultMaxTokens)
    bytesPerToken = positiveInt('bytes-per-token', values['bytes-per-token'], ORACLE_DEFAULTS.bytesPerToken)
    if (values['eos-after-tokens'] !== undefined) eosAfterTokens = positiveInt('eos-after-tokens', values['eos-after-tokens'], 1)
    const ids = values['stop-token-ids']?.split(',').map((v) => {
      const n = Number(v)
      if (!Number.isInteger(n) || n < 0) throw new Error(`--stop-token-ids must be a comma-separated list of token ids, got '${values['stop-token-ids']}'`)
      return n
    })
    const minTokens = positiveInt('min-tokens', values['min-tokens'], 0, 0)
    const stops = { stop: values.stop ?? null, stopTokenIds: ids ?? null, ignoreEos: values['ignore-eos'] ?? false, minTokens }
    if ((values.prompt === undefined) === (values.messages === undefined)) throw new Error('give exactly one of --prompt or --messages')
    if (values.messages !== undefined) {
      const messages = JSON.parse(values.messages) as unknown
      if (!Array.isArray(messages) || messages.length === 0 || !messages.every((m) => typeof m === 'object' && m !== null && typeof (m as { role?: unknown }).role === 'string')) {
        throw new Error('--messages must be a JSON array of {role, content} objects')
      }
      input = { kind: 'chat', messages: messages as ChatMessage[], maxTokens, ...stops }
    } else {
      input = { kind: 'completion', prompt: values.prompt as string, maxTokens, ...stops }
    }
  } catch (err) {
    process.stderr.write(`handoff sim oracle: ${(err as Error).message}\n\n${USAGE}`)
    process.exitCode = 2
    return
  }
  out.write(oracleText(input, { bytesPerToken, eosAfterTokens }))
}
