import { mkdirSync, readdirSync, readFileSync, writeFileSync } from 'node:fs'
import { join } from 'node:path'
import { packageRoot } from '../common/paths.js'
import { schemaId, sharedSchemas } from './index.js'

/** schemas/json/<$id>.json: the JSON Schema copies for consumers outside TypeScript. */
export const jsonDir = join(packageRoot, 'schemas', 'json')

export function renderedSchemas(): Map<string, string> {
  const out = new Map<string, string>()
  for (const s of sharedSchemas) out.set(`${schemaId(s)}.json`, JSON.stringify(s, null, 2) + '\n')
  return out
}

/** Returns the file names whose committed copy differs from the TypeBox source. */
export function staleSchemaFiles(): string[] {
  const want = renderedSchemas()
  const stale: string[] = []
  let have: string[] = []
  try {
    have = readdirSync(jsonDir).filter((f) => f.endsWith('.json'))
  } catch {
    // No folder yet: every file is stale.
  }
  for (const [name, text] of want) {
    let current: string | undefined
    try {
      current = readFileSync(join(jsonDir, name), 'utf8')
    } catch {
      current = undefined
    }
    if (current !== text) stale.push(name)
  }
  for (const f of have) if (!want.has(f)) stale.push(f)
  return stale
}

export function writeSchemas(): number {
  mkdirSync(jsonDir, { recursive: true })
  const files = renderedSchemas()
  for (const [name, text] of files) writeFileSync(join(jsonDir, name), text)
  return files.size
}
