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

/**
 * The CLI that child processes run: tsc's output bundled with its dependencies
 * (`npm run build`, scripts/bundle.mjs), as the image and bin/handoff.js run it.
 */
export const cliEntry: string = join(packageRoot, 'dist', 'handoff.js')
