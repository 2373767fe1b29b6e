import type { TObject } from 'typebox'
import { flagsOf, flagUsage, kebab, parseFlags, type Flag } from '../../common/schema-flags.js'
import { createAjv, describeErrors } from '../../schemas/ajv.js'
import type { KvEventsConfig } from '../../schemas/kv-events.js'
import { SimConfig } from '../../schemas/sim-config.js'
import { SIM_ERR_INVALID_CONFIG } from './errors.js'

/*
 * `handoff sim` flags → a validated, frozen SimConfig. Flags are the kebab-case of the
 * schema's keys (fault settings are flattened: --error-rate, not --faults.error-rate), so
 * adding a key to schemas/sim-config.ts adds its flag. The simulator reads no environment.
 */

const faultsSchema = (SimConfig.properties as { faults: TObject }).faults

// The fault settings are flattened: their flags sit beside the others.
const TOP = flagsOf(SimConfig, ['faults'])
const FAULTS = flagsOf(faultsSchema)
const ALL: readonly Flag[] = [...TOP, ...FAULTS]

export function usage(): string {
  return [
    'usage: handoff sim [options]',
    '       handoff sim oracle --max-tokens N (--prompt TEXT | --messages JSON) [--bytes-per-token N]',
    '',
    'A vLLM-compatible engine simulator (see docs/sim.md).',
    '',
    'options:',
    ...flagUsage(ALL),
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
  let flat: Record<string, unknown> | 'help'
  try {
    flat = parseFlags(ALL, argv)
  } catch (err) {
    throw new SIM_ERR_INVALID_CONFIG((err as Error).message)
  }
  if (flat === 'help') return 'help'
  const raw: Record<string, unknown> = {}
  const faults: Record<string, unknown> = {}
  for (const f of TOP) if (f.key in flat) raw[f.key] = flat[f.key]
  for (const f of FAULTS) if (f.key in flat) faults[f.key] = flat[f.key]
  raw.faults = faults
  try {
    return validateSimConfig(raw)
  } catch (err) {
    // Name the flag, not the schema path: "/faults/errorRate must be <= 1" → "--error-rate must be <= 1".
    const e = err as Error
    const message = e.message.replace(/\/(?:faults\/)?([A-Za-z]+)/g, (m, key: string) =>
      ALL.some((f) => f.key === key) ? `--${kebab(key)}` : m,
    )
    throw new SIM_ERR_INVALID_CONFIG(message.replace(/^Invalid simulator configuration: /, ''))
  }
}

/** Validates (filling defaults) and freezes a config object. */
export function validateSimConfig(raw: Record<string, unknown>): Readonly<SimConfig> {
  const ajv = createAjv({ verbose: true })
  const validate = ajv.getSchema<SimConfig>('SimConfig')
  if (!validate) throw new SIM_ERR_INVALID_CONFIG('SimConfig schema not registered')
  const copy = structuredClone(raw)
  if (!validate(copy)) throw new SIM_ERR_INVALID_CONFIG(describeErrors(validate.errors))
  const config = copy as SimConfig
  // A rule across keys, which the schema does not express.
  if (config.kv === 'agent' && config.agentUrl === undefined) throw new SIM_ERR_INVALID_CONFIG('/agentUrl is required with --kv agent')
  if (config.dataParallelRank !== undefined && config.dataParallelRank >= config.dataParallelSize) {
    throw new SIM_ERR_INVALID_CONFIG(`/dataParallelRank must be below --data-parallel-size (${config.dataParallelSize})`)
  }
  if (config.kvEventsConfig !== undefined) kvEventsConfigOf(config)
  // One transfer agent serves one engine; vLLM runs one NIXL agent per rank.
  if (config.kv === 'agent' && config.dataParallelSize > 1 && config.dataParallelRank === undefined) {
    throw new SIM_ERR_INVALID_CONFIG('/dataParallelSize above 1 serves every rank behind one port: --kv none only (with --kv agent, one process per rank: --data-parallel-rank)')
  }
  return deepFreeze(config)
}

/**
 * `--kv-events-config` parsed and checked against vLLM's KVEventsConfig, defaults filled;
 * undefined when it is absent or does not enable events (vLLM's null publisher).
 */
export function kvEventsConfigOf(config: Readonly<SimConfig>): KvEventsConfig | undefined {
  if (config.kvEventsConfig === undefined) return undefined
  let raw: unknown
  try {
    raw = JSON.parse(config.kvEventsConfig)
  } catch (err) {
    throw new SIM_ERR_INVALID_CONFIG(`--kv-events-config is not JSON: ${(err as Error).message}`)
  }
  const validate = createAjv({ verbose: true }).getSchema<KvEventsConfig>('KvEventsConfig')
  if (!validate) throw new SIM_ERR_INVALID_CONFIG('KvEventsConfig schema not registered')
  if (!validate(raw)) throw new SIM_ERR_INVALID_CONFIG(`--kv-events-config: ${describeErrors(validate.errors)}`)
  const checked = raw as KvEventsConfig
  const publisher = checked.publisher ?? (checked.enable_kv_cache_events ? 'zmq' : 'null')
  return checked.enable_kv_cache_events && publisher === 'zmq' ? { ...checked, publisher } : undefined
}
