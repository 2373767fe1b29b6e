import { Ajv, type Options } from 'ajv'
import addFormatsModule from 'ajv-formats'
import { sharedSchemas } from './index.js'

// ajv-formats is CJS with a default export; under NodeNext the callable sits on `.default`.
const addFormats = addFormatsModule as unknown as typeof addFormatsModule.default

/**
 * An Ajv in strict mode with every shared schema registered. `useDefaults` fills config
 * defaults; nothing is coerced or stripped, so validation never changes a wire message.
 */
export function createAjv(opts: Options = {}): Ajv {
  const ajv = new Ajv({ strict: true, allErrors: true, useDefaults: true, ...opts })
  addFormats(ajv)
  for (const s of sharedSchemas) ajv.addSchema(s)
  return ajv
}

/** What describeErrors reads of an ajv error (`parentSchema` and `data` with `verbose: true`). */
export interface AjvErrorLike {
  instancePath: string
  keyword?: string
  message?: string
  params?: Record<string, unknown>
  parentSchema?: unknown
  data?: unknown
}

/**
 * Formats ajv errors as one line that says what to fix, each fact once:
 * `/instances/0/role must be one of "prefill", "decode", "both" (got "prefil"); /timeouts has
 * an unknown key "prefilMs" (did you mean "prefillMs"?)`. A union of literals (TypeBox compiles
 * it to anyOf of const) becomes one "must be one of"; the nearest known key needs the schema
 * (an Ajv made with `verbose: true`, as the config loaders make theirs).
 */
export function describeErrors(errors: readonly AjvErrorLike[] | null | undefined): string {
  if (!errors?.length) return 'invalid'
  // The literals each path may take, from the const branches of its anyOf.
  const allowed = new Map<string, unknown[]>()
  for (const e of errors) {
    if (e.keyword !== 'const' || !e.params || !('allowedValue' in e.params)) continue
    const at = e.instancePath || '/'
    allowed.set(at, [...(allowed.get(at) ?? []), e.params.allowedValue])
  }
  const lines: string[] = []
  for (const e of errors) {
    const at = e.instancePath || '/'
    const got = 'data' in e && e.data !== undefined && typeof e.data !== 'object' ? ` (got ${JSON.stringify(e.data)})` : ''
    let line: string
    if ((e.keyword === 'const' || e.keyword === 'anyOf') && allowed.has(at)) {
      line = `${at} must be one of ${(allowed.get(at) as unknown[]).map((v) => JSON.stringify(v)).join(', ')}${got}`
    } else if (e.keyword === 'enum' && Array.isArray(e.params?.allowedValues)) {
      line = `${at} must be one of ${e.params.allowedValues.map((v) => JSON.stringify(v)).join(', ')}${got}`
    } else if (e.keyword === 'additionalProperties' && typeof e.params?.additionalProperty === 'string') {
      const key = e.params.additionalProperty
      const near = nearest(key, Object.keys((e.parentSchema as { properties?: Record<string, unknown> } | undefined)?.properties ?? {}))
      line = `${at} has an unknown key ${JSON.stringify(key)}${near ? ` (did you mean ${JSON.stringify(near)}?)` : ''}`
    } else {
      line = `${at} ${e.message ?? 'is invalid'}${got}`
    }
    if (!lines.includes(line)) lines.push(line)
  }
  return lines.join('; ')
}

/** The known key closest to `key` by edit distance, if close enough to be a slip (at most a third of it). */
function nearest(key: string, known: readonly string[]): string | undefined {
  let best: string | undefined
  let bestD = Math.max(1, Math.floor(key.length / 3)) + 1
  for (const k of known) {
    const d = distance(key.toLowerCase(), k.toLowerCase())
    if (d < bestD) {
      best = k
      bestD = d
    }
  }
  return best
}

/** Levenshtein distance. */
function distance(a: string, b: string): number {
  let prev = Array.from({ length: b.length + 1 }, (_, j) => j)
  for (let i = 1; i <= a.length; i++) {
    const cur = [i]
    for (let j = 1; j <= b.length; j++) cur[j] = Math.min((prev[j] as number) + 1, (cur[j - 1] as number) + 1, (prev[j - 1] as number) + (a[i - 1] === b[j - 1] ? 0 : 1))
    prev = cur
  }
  return prev[b.length] as number
}
