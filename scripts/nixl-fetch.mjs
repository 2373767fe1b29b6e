#!/usr/bin/env node
// Finds NIXL's C API library for the native addon, or fetches the nixl-cu12 wheel.
//
// Plain Node (no TypeScript): it runs at install time, before anything is built. Order, first
// hit wins (the same order as native/nixl-locate.ts uses at run time):
//   1. NIXL_LIB_DIR, a directory holding libnixl_capi.so;
//   2. an installed nixl_cu12 / nixl_cu13 Python package (found with importlib, not imported);
//   3. the cache .cache/nixl/<wheel>/ (from an earlier run);
//   4. otherwise: pip download of the nixl-cu12 wheel (>= 1.3, no deps, so no torch) into
//      .cache/nixl/, unzipped there.
// Prints plainly what it found and where. Exit code 1 under CI=true when NIXL cannot be had;
// elsewhere 0 with a warning, so a laptop without network can still install.
import { execFileSync } from 'node:child_process'
import { existsSync, mkdirSync, readdirSync, renameSync, rmSync, statSync } from 'node:fs'
import { dirname, join } from 'node:path'
import { fileURLToPath } from 'node:url'

const root = dirname(dirname(fileURLToPath(import.meta.url)))
const cacheDir = join(root, '.cache', 'nixl')
const requirement = process.env.NIXL_WHEEL_REQUIREMENT || 'nixl-cu12>=1.3'
const ci = process.env.CI === 'true' || process.env.CI === '1'
const python = process.env.PYTHON || 'python3'

function say(msg) {
  process.stdout.write(`nixl-fetch: ${msg}\n`)
}

function fail(msg) {
  process.stderr.write(`nixl-fetch: ${msg}\n`)
  if (ci) {
    process.stderr.write('nixl-fetch: CI=true, and CI needs real NIXL: failing.\n')
    process.exit(1)
  }
  process.stderr.write('nixl-fetch: continuing without NIXL; tests that need it will be skipped.\n')
  process.exit(0)
}

function versionNear(libDir) {
  try {
    for (const n of readdirSync(dirname(libDir))) {
      const m = /^(nixl_cu1[23])-([0-9][^-]*)\.dist-info$/.exec(n)
      if (m) return `${m[1]} ${m[2]}`
    }
  } catch {
    // no dist-info: version unknown
  }
  return 'version unknown'
}

function report(source, libDir) {
  say(`using NIXL from ${source}: ${libDir} (${versionNear(libDir)})`)
  say(`plugins: ${existsSync(join(libDir, 'plugins', 'libplugin_UCX.so')) ? 'UCX present' : 'UCX plugin MISSING'}`)
}

// 1. Explicit directory.
const envDir = process.env.NIXL_LIB_DIR
if (envDir) {
  if (!existsSync(join(envDir, 'libnixl_capi.so'))) fail(`NIXL_LIB_DIR=${envDir} holds no libnixl_capi.so`)
  report('NIXL_LIB_DIR', envDir)
  process.exit(0)
}

// 2. Installed Python package (find_spec does not import it, so torch is never loaded).
try {
  const code = [
    'import importlib.util, os, sys',
    'for n in ("nixl_cu12", "nixl_cu13"):',
    '    s = importlib.util.find_spec(n)',
    '    if s and s.submodule_search_locations:',
    '        print(os.path.join(os.path.dirname(s.submodule_search_locations[0]), "." + n + ".mesonpy.libs"))',
  ].join('\n')
  const out = execFileSync(python, ['-c', code], { encoding: 'utf8', stdio: ['ignore', 'pipe', 'ignore'], timeout: 20000 })
  for (const dir of out.split('\n').filter(Boolean)) {
    if (existsSync(join(dir, 'libnixl_capi.so'))) {
      report('the installed Python package', dir)
      process.exit(0)
    }
  }
} catch {
  // no python3 or no package: fall through to the cache
}

// 3. Cache from an earlier run.
function cached() {
  if (!existsSync(cacheDir)) return null
  const dirs = readdirSync(cacheDir)
    .filter((d) => /^nixl_cu1[23]-[0-9]/.test(d))
    .filter((d) => existsSync(join(cacheDir, d, `.${d.split('-')[0]}.mesonpy.libs`, 'libnixl_capi.so')))
    .sort((a, b) => b.localeCompare(a, 'en', { numeric: true }))
  const d = dirs[0]
  return d ? join(cacheDir, d, `.${d.split('-')[0]}.mesonpy.libs`) : null
}
const hit = cached()
if (hit) {
  report('the cache', hit)
  process.exit(0)
}

// 4. Download. --python-version 3.12: the wheels are built for CPython 3.12 only, and the C
// libraries do not care which Python the host has. manylinux_2_28 needs glibc >= 2.28.
mkdirSync(cacheDir, { recursive: true })
say(`downloading ${requirement} (manylinux_2_28_x86_64, no dependencies) into ${cacheDir}`)
try {
  execFileSync(
    python,
    ['-m', 'pip', 'download', '--no-deps', '--only-binary=:all:', '--python-version', '3.12',
      '--platform', 'manylinux_2_28_x86_64', '--disable-pip-version-check', '-d', cacheDir, requirement],
    { stdio: ['ignore', 'inherit', 'inherit'], timeout: 600000 },
  )
} catch (err) {
  fail(`pip could not download ${requirement} from PyPI (${err instanceof Error ? err.message.split('\n')[0] : err}). ` +
    'Check network access to PyPI, or set NIXL_LIB_DIR to a directory holding libnixl_capi.so.')
}
const wheels = readdirSync(cacheDir).filter((f) => /^nixl_cu1[23]-.*\.whl$/.test(f))
  .sort((a, b) => statSync(join(cacheDir, b)).mtimeMs - statSync(join(cacheDir, a)).mtimeMs)
const wheel = wheels[0]
if (!wheel) fail('pip reported success but left no nixl wheel in the cache')
const [dist, version] = wheel.split('-')
const target = join(cacheDir, `${dist}-${version}`)
const partial = `${target}.partial`
rmSync(partial, { recursive: true, force: true })
say(`unzipping ${wheel}`)
try {
  // python's zipfile module: no dependency on an unzip binary.
  execFileSync(python, ['-m', 'zipfile', '-e', join(cacheDir, wheel), partial], { stdio: 'inherit', timeout: 600000 })
} catch (err) {
  fail(`could not unzip ${wheel}: ${err instanceof Error ? err.message : err}`)
}
rmSync(target, { recursive: true, force: true })
renameSync(partial, target) // atomic: a half-unzipped tree is never taken for a good one
// The wheel is no longer needed once unpacked (68 MB).
rmSync(join(cacheDir, wheel), { force: true })
const libDir = join(target, `.${dist}.mesonpy.libs`)
if (!existsSync(join(libDir, 'libnixl_capi.so'))) fail(`${wheel} holds no libnixl_capi.so`)
report('a freshly downloaded wheel', libDir)
