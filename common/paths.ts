import { existsSync } from 'node:fs'
import { dirname, join } from 'node:path'
import { fileURLToPath } from 'node:url'

/**
 * The package root, found from this file whether it runs as TS source (`common/paths.ts`)
 * or compiled (`dist/common/paths.js`).
 */
export const packageRoot: string = (() => {
  let dir = dirname(fileURLToPath(import.meta.url))
  for (let i = 0; i < 5; i++) {
    if (existsSync(join(dir, 'package.json')) && !dir.endsWith('dist')) return dir
    dir = dirname(dir)
  }
  throw new Error('handoff package root not found')
})()

/** The compiled CLI entry that child processes run (`npm run build` produces it). */
export const cliEntry: string = join(packageRoot, 'dist', 'cli', 'main.js')
