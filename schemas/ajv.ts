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

/** Formats ajv errors as one line: `/timeouts/prefillMs must be >= 1; ...`. */
export function describeErrors(errors: readonly { instancePath: string; message?: string }[] | null | undefined): string {
  if (!errors?.length) return 'invalid'
  return errors.map((e) => `${e.instancePath || '/'} ${e.message ?? 'is invalid'}`).join('; ')
}
