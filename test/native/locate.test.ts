// nixl-locate: NIXL_LIB_DIR, installed Python package, fetch cache, version from dist-info.
import { chmodSync, mkdirSync, mkdtempSync, rmSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import t from 'tap'
import { fromCache, locateNixl, versionNear } from '../../native/nixl-locate.js'

const root = mkdtempSync(join(tmpdir(), 'handoff-locate-'))
t.teardown(() => rmSync(root, { recursive: true, force: true }))

function fakeWheel(dir: string, variant: string, version: string): string {
  const lib = join(dir, `.${variant}.mesonpy.libs`)
  mkdirSync(lib, { recursive: true })
  writeFileSync(join(lib, 'libnixl_capi.so'), '')
  mkdirSync(join(dir, `${variant}-${version}.dist-info`), { recursive: true })
  return lib
}

t.test('NIXL_LIB_DIR wins and is taken as given', async (t) => {
  const lib = fakeWheel(join(root, 'env'), 'nixl_cu12', '1.4.0')
  t.same(await locateNixl({ libDir: lib, python: null }), { libDir: lib, source: 'NIXL_LIB_DIR', variant: 'nixl_cu12', version: '1.4.0' })
  const empty = join(root, 'empty')
  mkdirSync(empty)
  t.same(await locateNixl({ libDir: empty }), { libDir: empty, source: 'NIXL_LIB_DIR', variant: null, version: null }, 'even when empty')
})

t.test('cache: newest version of the preferred variant', async (t) => {
  const cache = join(root, 'cache')
  fakeWheel(join(cache, 'nixl_cu12-1.3.0'), 'nixl_cu12', '1.3.0')
  const newest = fakeWheel(join(cache, 'nixl_cu12-1.10.2'), 'nixl_cu12', '1.10.2')
  const cu13 = fakeWheel(join(cache, 'nixl_cu13-1.5.1'), 'nixl_cu13', '1.5.1')
  mkdirSync(join(cache, 'nixl_cu12-9.9.9')) // unpacked badly: no library, ignored
  t.same(await locateNixl({ cacheDir: cache, python: null }), { libDir: newest, source: 'cache', variant: 'nixl_cu12', version: '1.10.2' })
  t.equal((await locateNixl({ cacheDir: cache, python: null, cudaMajor: 13 }))?.libDir, cu13, 'CUDA 13 prefers cu13')
  t.equal(fromCache(join(root, 'nope')), null)
  t.equal(await locateNixl({ cacheDir: join(root, 'nope'), python: null }), null, 'nothing anywhere')
})

t.test('installed Python package found without importing it', async (t) => {
  const site = join(root, 'site')
  fakeWheel(site, 'nixl_cu12', '1.5.0')
  mkdirSync(join(site, 'nixl_cu12'), { recursive: true })
  writeFileSync(join(site, 'nixl_cu12', '__init__.py'), 'raise SystemExit("must not be imported")\n')
  // A python3 wrapper that puts the fake site-packages on the path.
  const py = join(root, 'python-wrapper')
  writeFileSync(py, `#!/bin/sh\nPYTHONPATH=${site} exec python3 "$@"\n`)
  chmodSync(py, 0o755)
  const hit = await locateNixl({ python: py, cacheDir: join(root, 'nope') })
  t.same(hit, { libDir: join(site, '.nixl_cu12.mesonpy.libs'), source: 'python', variant: 'nixl_cu12', version: '1.5.0' })
  t.equal(await locateNixl({ python: join(root, 'no-such-python'), cacheDir: join(root, 'nope') }), null, 'a missing interpreter is not an error')
})

t.test('versionNear', async (t) => {
  t.equal(versionNear(join(root, 'missing', '.nixl_cu12.mesonpy.libs'), 'nixl_cu12'), null)
  const lib = fakeWheel(join(root, 'v'), 'nixl_cu13', '2.0.0')
  t.equal(versionNear(lib, null), '2.0.0', 'any variant when unknown')
})
