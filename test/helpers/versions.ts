import { readFileSync } from 'node:fs'
import { dirname, join, resolve } from 'node:path'
import { fileURLToPath } from 'node:url'

export const repoRoot = resolve(dirname(fileURLToPath(import.meta.url)), '../..')

/** A `KEY=value` file under scripts/ (k8s-versions, vllm-versions): the one place a pinned version is written. */
export function versionsFile(name: string): Record<string, string> {
  const out: Record<string, string> = {}
  for (const line of readFileSync(join(repoRoot, 'scripts', name), 'utf8').split('\n')) {
    const m = /^([A-Z_]+)=(\S+)$/.exec(line.trim())
    if (m?.[1] && m[2]) out[m[1]] = m[2]
  }
  return out
}
