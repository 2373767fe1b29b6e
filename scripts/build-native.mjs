#!/usr/bin/env node
// Builds native/ with npm's bundled node-gyp (run through `npm run build:native`).
//
// node-gyp normally downloads Node's headers from nodejs.org. CI machines here reach only the
// package registries, and Debian/NodeSource Node installs its headers under
// <prefix>/include/node, so point node-gyp at that prefix when the headers are there.
import { spawnSync } from 'node:child_process'
import { existsSync, readdirSync, readFileSync, statSync, writeFileSync } from 'node:fs'
import { dirname, join } from 'node:path'
import { fileURLToPath } from 'node:url'

const root = dirname(dirname(fileURLToPath(import.meta.url)))
const native = join(root, 'native')
const addon = join(native, 'build', 'Release', 'handoff_native.node')
const stamp = join(native, 'build', 'built-for')

// `prepare` runs on every `npm install <pkg>`: rebuild only when a source changed since the
// addon was built, or the addon was built for another Node (issue 38).
function upToDate() {
  if (!existsSync(addon) || !existsSync(stamp) || readFileSync(stamp, 'utf8') !== `${process.version} ${process.arch}`) return false
  const built = statSync(addon).mtimeMs
  const sources = [join(native, 'binding.gyp'), ...readdirSync(join(native, 'src')).map((f) => join(native, 'src', f))]
  return sources.every((f) => statSync(f).mtimeMs < built)
}
if (upToDate() && !process.env.HANDOFF_REBUILD_NATIVE) {
  process.stdout.write(`build-native: ${addon} is up to date (HANDOFF_REBUILD_NATIVE=1 rebuilds)\n`)
  process.exit(0)
}
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
if (res.status === 0) writeFileSync(stamp, `${process.version} ${process.arch}`)
process.exit(res.status ?? 1)
