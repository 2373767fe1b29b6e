import { parseArgs } from 'node:util'
import type { TObject } from 'typebox'

/*
 * Command-line flags for a flat config schema: each key's kebab-case is its flag
 * (`leaseSeconds` → `--lease-seconds`), numbers are parsed, booleans take no value and
 * `--no-<flag>` turns one off (vLLM's own form, for settings on by default). The
 * schema stays the one place where a setting, its type and its default are defined; the
 * caller validates the result against it.
 */

type Kind = 'string' | 'number' | 'integer' | 'boolean'

export interface Flag {
  flag: string
  key: string
  kind: Kind
  description: string
}

export const kebab = (key: string): string => key.replace(/[A-Z]/g, (c) => `-${c.toLowerCase()}`)

export function flagsOf(schema: TObject, skip: readonly string[] = []): Flag[] {
  const out: Flag[] = []
  for (const [key, s] of Object.entries(schema.properties as Record<string, unknown>)) {
    if (skip.includes(key)) continue
    const sch = s as { type?: unknown; anyOf?: { const?: unknown }[]; default?: unknown }
    const kind: Kind = sch.type === 'integer' || sch.type === 'number' || sch.type === 'boolean' ? sch.type : 'string'
    const parts: string[] = []
    if (sch.anyOf) parts.push(sch.anyOf.map((a) => String(a.const)).join('|'))
    if (sch.default !== undefined && typeof sch.default !== 'object') parts.push(`default ${String(sch.default)}`)
    if (kind === 'boolean' && sch.default === true) parts.push(`--no-${kebab(key)} turns it off`)
    out.push({ flag: kebab(key), key, kind, description: parts.join(', ') })
  }
  return out
}

export function flagUsage(flags: readonly Flag[]): string[] {
  return flags.map((f) => `  --${`${f.flag}${f.kind === 'boolean' ? '' : ' <' + f.kind + '>'}`.padEnd(30)} ${f.description}`)
}

/**
 * argv → a raw config object (not yet validated) or 'help'. Throws Error with parseArgs'
 * message for unknown flags or missing values.
 */
export function parseFlags(flags: readonly Flag[], argv: readonly string[]): Record<string, unknown> | 'help' {
  const options: Record<string, { type: 'string' | 'boolean' }> = { help: { type: 'boolean' } }
  for (const f of flags) {
    options[f.flag] = { type: f.kind === 'boolean' ? 'boolean' : 'string' }
    if (f.kind === 'boolean') options[`no-${f.flag}`] = { type: 'boolean' }
  }
  const { values } = parseArgs({ args: [...argv], options, strict: true, allowPositionals: false })
  if (values.help) return 'help'
  const raw: Record<string, unknown> = {}
  const given = values as Record<string, string | boolean | undefined>
  for (const f of flags) {
    if (f.kind === 'boolean' && given[`no-${f.flag}`] === true) {
      if (given[f.flag] !== undefined) throw new Error(`--${f.flag} and --no-${f.flag} contradict each other`)
      raw[f.key] = false
      continue
    }
    const v = given[f.flag]
    if (v === undefined) continue
    // Non-numeric text stays a string so the schema reports it against the right key.
    raw[f.key] = (f.kind === 'number' || f.kind === 'integer') && typeof v === 'string' && v.trim() !== '' && Number.isFinite(Number(v)) ? Number(v) : v
  }
  return raw
}
