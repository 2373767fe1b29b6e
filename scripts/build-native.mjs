#!/usr/bin/env node
// Builds native/ with npm's bundled node-gyp (run through `npm run build:native`).
//
// node-gyp normally downloads Node's headers from nodejs.org. CI machines here reach only the
// package registries, and Debian/NodeSource Node installs its headers under
// <prefix>/include/node, so point node-gyp at that prefix when the headers are there.
import { spawnSync } from 'node:child_process'
import { existsSync } from 'node:fs'
import { dirname, join } from 'node:path'
import { fileURLToPath } from 'node:url'

const root = dirname(dirname(fileURLToPath(import.meta.url)))
const prefix = dirname(dirname(process.execPath))
const args = ['rebuild', '-C', join(root, 'native')]
if (existsSync(join(prefix, 'include', 'node', 'node_api.h')) && !process.env.npm_config_nodedir) {
  args.push(`--nodedir=${prefix}`)
}
// npm sets npm_config_node_gyp to its bundled copy; fall back to a node-gyp on PATH.
const gyp = process.env.npm_config_node_gyp
const res = gyp
  ? spawnSync(process.execPath, [gyp, ...args], { stdio: 'inherit' })
  : spawnSync('node-gyp', args, { stdio: 'inherit', shell: false })
if (res.error) {
  process.stderr.write(`build-native: could not run node-gyp: ${res.error.message}\n`)
  process.exit(1)
}
process.exit(res.status ?? 1)
