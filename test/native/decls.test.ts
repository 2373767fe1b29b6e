// Compiles native/src/nixl_api.h against NIXL's own C prototypes (wrapper.h from the nixl-sys
// crate of the NIXL version in use), so drift fails here, not at run time. The crate is
// fetched with cargo into .cache/ (never committed); no build, no libclang.
import { execFile } from 'node:child_process'
import { existsSync, mkdirSync, readFileSync, writeFileSync } from 'node:fs'
import { dirname, join } from 'node:path'
import { promisify } from 'node:util'
import t from 'tap'
import { packageRoot } from '../../common/paths.js'
import { locateNixl } from '../../native/index.js'
import { ci } from './helpers.js'

const run = promisify(execFile)

async function have(cmd: string): Promise<boolean> {
  return run(cmd, ['--version'], { timeout: 20_000 }).then(
    () => true,
    () => false,
  )
}

t.test('nixl_api.h matches wrapper.h', async (t) => {
  const where = await locateNixl({ libDir: process.env.NIXL_LIB_DIR })
  const version = where?.version ?? null
  const cxx = process.env.CXX ?? 'c++'
  const missing = !version ? 'NIXL not available (its version picks the nixl-sys crate)' : !(await have('cargo')) ? 'cargo not available' : !(await have(cxx)) ? `${cxx} not available` : null
  if (missing) {
    if (ci) t.fail(`${missing} (CI=true requires this check)`)
    else t.plan(0, missing)
    return
  }
  t.comment(`checking against nixl-sys ${version}`)
  const crate = join(packageRoot, '.cache', 'nixl-sys-check', String(version))
  mkdirSync(join(crate, 'src'), { recursive: true })
  writeFileSync(
    join(crate, 'Cargo.toml'),
    `[package]\nname = "nixl-sys-check"\nversion = "0.0.0"\nedition = "2021"\n\n[dependencies]\nnixl-sys = { version = "=${version}", features = ["stub-api"] }\n`,
  )
  writeFileSync(join(crate, 'src', 'lib.rs'), '')
  let metadata: string
  try {
    await run('cargo', ['fetch', '--manifest-path', join(crate, 'Cargo.toml')], { timeout: 180_000 })
    ;({ stdout: metadata } = await run('cargo', ['metadata', '--format-version', '1', '--manifest-path', join(crate, 'Cargo.toml')], {
      timeout: 60_000,
      maxBuffer: 64 << 20,
    }))
  } catch (err) {
    const why = `cargo could not fetch nixl-sys ${version}: ${(err as Error).message.split('\n')[0]}`
    if (ci) t.fail(why)
    else t.plan(0, why)
    return
  }
  const pkgs = (JSON.parse(metadata) as { packages: { name: string; manifest_path: string }[] }).packages
  const sys = pkgs.find((p) => p.name === 'nixl-sys')
  const header = sys ? join(dirname(sys.manifest_path), 'wrapper.h') : ''
  t.ok(existsSync(header), `wrapper.h at ${header}`)
  const defines = readFileSync(header, 'utf8').includes('NIXL_CAPI_ERROR_NOT_FOUND') ? ['-DHNX_EXPECT_NOT_FOUND'] : []
  const args = ['-std=c++17', '-fsyntax-only', '-Wall', `-I${dirname(header)}`, `-I${join(packageRoot, 'native', 'src')}`, ...defines]
  const src = join(packageRoot, 'test', 'native', 'decls-check.cc')

  const ok = await run(cxx, [...args, src], { timeout: 120_000 }).then(
    () => '',
    (e: { stderr?: string }) => e.stderr ?? 'failed',
  )
  t.equal(ok, '', 'every declaration, enum value and the config layout agree')
  const selftest = await run(cxx, [...args, '-DHNX_SELFTEST_MISMATCH', src], { timeout: 120_000 }).then(
    () => '',
    (e: { stderr?: string }) => e.stderr ?? 'failed',
  )
  t.match(selftest, /deliberate mismatch/, 'a wrong declaration does fail the check')
})
