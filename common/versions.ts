import { readFileSync } from 'node:fs'
import { join } from 'node:path'
import { packageRoot } from './paths.js'

/**
 * A `KEY=value` file under scripts/ (k8s-versions, vllm-versions): the one place each pinned
 * tool version is written, read by the install scripts, the tests and the benches alike.
 */
export function versionsFile(name: string): Record<string, string> {
  const out: Record<string, string> = {}
  for (const line of readFileSync(join(packageRoot, 'scripts', name), 'utf8').split('\n')) {
    const m = /^([A-Z_]+)=(\S+)$/.exec(line.trim())
    if (m?.[1] && m[2]) out[m[1]] = m[2]
  }
  return out
}

/** handoff's own version (package.json), as `handoff --version` prints it. */
export function handoffVersion(): string {
  return (JSON.parse(readFileSync(join(packageRoot, 'package.json'), 'utf8')) as { version: string }).version
}
