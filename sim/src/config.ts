import { parseArgs } from 'node:util'
import { createAjv, describeErrors } from '../../schemas/ajv.js'
import { SimConfig } from '../../schemas/sim-config.js'
import { SIM_ERR_INVALID_CONFIG } from './errors.js'

/*
 * `handoff sim` flags → a validated, frozen SimConfig. Flags are the kebab-case of the
 * schema's keys (fault settings are flattened: --error-rate, not --faults.error-rate), so
 * adding a key to schemas/sim-config.ts adds its flag. The simulator reads no environment.
 */

type Kind = 'string' | 'number' | 'integer' | 'boolean'
interface FlagSpec {
  flag: string
  key: string
  inFaults: boolean
  kind: Kind
  description: string
}

const kebab = (key: string): string => key.replace(/[A-Z]/g, (c) => `-${c.toLowerCase()}`)

function kindOf(schema: unknown): Kind {
  const s = schema as { type?: unknown; anyOf?: unknown[] }
  if (s.type === 'integer' || s.type === 'number' || s.type === 'boolean') return s.type
  return 'string'
}

function describe(schema: unknown): string {
  const s = schema as { default?: unknown; anyOf?: { const?: unknown }[]; minimum?: number; maximum?: number }
  const parts: string[] = []
  if (s.anyOf) parts.push(s.anyOf.map((a) => String(a.const)).join('|'))
  if (s.default !== undefined && typeof s.default !== 'object') parts.push(`default ${String(s.default)}`)
  return parts.join(', ')
}

function flagSpecs(): FlagSpec[] {
  const out: FlagSpec[] = []
  const props = SimConfig.properties as Record<string, unknown>
  for (const [key, schema] of Object.entries(props)) {
    if (key === 'faults') {
      const faultProps = (schema as { properties: Record<string, unknown> }).properties
      for (const [fk, fs] of Object.entries(faultProps)) {
        out.push({ flag: kebab(fk), key: fk, inFaults: true, kind: kindOf(fs), description: describe(fs) })
      }
    } else {
      out.push({ flag: kebab(key), key, inFaults: false, kind: kindOf(schema), description: describe(schema) })
    }
  }
  return out
}

export const FLAGS: readonly FlagSpec[] = Object.freeze(flagSpecs())

export function usage(): string {
  const lines = FLAGS.map((f) => `  --${`${f.flag}${f.kind === 'boolean' ? '' : ' <' + f.kind + '>'}`.padEnd(30)} ${f.description}`)
  return [
    'usage: handoff sim [options]',
    '       handoff sim oracle --max-tokens N (--prompt TEXT | --messages JSON) [--bytes-per-token N]',
    '',
    'A vLLM-compatible engine simulator (see docs/sim.md).',
    '',
    'options:',
    ...lines,
    '  --help                         this text',
    '',
  ].join('\n')
}

function deepFreeze<T>(o: T): T {
  if (o && typeof o === 'object') {
    for (const v of Object.values(o)) deepFreeze(v)
    Object.freeze(o)
  }
  return o
}

/** Parses argv; returns 'help' for --help. Throws SIM_ERR_INVALID_CONFIG on any bad flag. */
export function parseSimArgs(argv: readonly string[]): Readonly<SimConfig> | 'help' {
  const options: Record<string, { type: 'string' | 'boolean' }> = { help: { type: 'boolean' } }
  for (const f of FLAGS) options[f.flag] = { type: f.kind === 'boolean' ? 'boolean' : 'string' }
  let values: Record<string, string | boolean | undefined>
  try {
    values = parseArgs({ args: [...argv], options, strict: true, allowPositionals: false }).values as Record<string, string | boolean | undefined>
  } catch (err) {
    throw new SIM_ERR_INVALID_CONFIG((err as Error).message)
  }
  if (values.help) return 'help'
  const raw: Record<string, unknown> = {}
  const faults: Record<string, unknown> = {}
  for (const f of FLAGS) {
    const v = values[f.flag]
    if (v === undefined) continue
    let parsed: unknown = v
    // Non-numeric text stays a string so the schema reports it against the right key.
    if ((f.kind === 'number' || f.kind === 'integer') && typeof v === 'string' && v.trim() !== '' && Number.isFinite(Number(v))) {
      parsed = Number(v)
    }
    ;(f.inFaults ? faults : raw)[f.key] = parsed
  }
  raw.faults = faults
  try {
    return validateSimConfig(raw)
  } catch (err) {
    // Name the flag, not the schema path: "/faults/errorRate must be <= 1" → "--error-rate must be <= 1".
    const e = err as Error
    const message = e.message.replace(/\/(?:faults\/)?([A-Za-z]+)/g, (m, key: string) =>
      FLAGS.some((f) => f.key === key) ? `--${kebab(key)}` : m,
    )
    throw new SIM_ERR_INVALID_CONFIG(message.replace(/^Invalid simulator configuration: /, ''))
  }
}

/** Validates (filling defaults) and freezes a config object. */
export function validateSimConfig(raw: Record<string, unknown>): Readonly<SimConfig> {
  const ajv = createAjv()
  const validate = ajv.getSchema<SimConfig>('SimConfig')
  if (!validate) throw new SIM_ERR_INVALID_CONFIG('SimConfig schema not registered')
  const copy = structuredClone(raw)
  if (!validate(copy)) throw new SIM_ERR_INVALID_CONFIG(describeErrors(validate.errors))
  const config = copy as SimConfig
  // A rule across keys, which the schema does not express.
  if (config.kv === 'agent' && config.agentUrl === undefined) throw new SIM_ERR_INVALID_CONFIG('/agentUrl is required with --kv agent')
  return deepFreeze(config)
}
