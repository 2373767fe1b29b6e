import { execFile } from 'node:child_process'
import { existsSync, readdirSync } from 'node:fs'
import { basename, dirname, join } from 'node:path'
import { promisify } from 'node:util'
import { packageRoot } from '../common/paths.js'

const execFileAsync = promisify(execFile)

/** The NIXL wheel variants; the C and C++ libraries do not depend on the Python version. */
export type NixlVariant = 'nixl_cu12' | 'nixl_cu13'

export interface NixlLocation {
  /** Absolute directory holding `libnixl_capi.so` (may be empty when it came from NIXL_LIB_DIR). */
  libDir: string
  /** How it was found; the first hit wins, in this order. */
  source: 'NIXL_LIB_DIR' | 'python' | 'cache'
  variant: NixlVariant | null
  /** From the wheel's `nixl_cuXX-<version>.dist-info` next to the library directory. */
  version: string | null
}

export interface LocateOptions {
  /** Value of NIXL_LIB_DIR; the caller's config reads the environment, not this module. */
  libDir?: string | undefined
  /** Python interpreter for the installed-package lookup; null skips that step. */
  python?: string | null
  /** Cache written by scripts/nixl-fetch.mjs (default `<package root>/.cache/nixl`). */
  cacheDir?: string
  /** CUDA major version of the node, to prefer the matching variant. */
  cudaMajor?: number | null
}

const VARIANTS: readonly NixlVariant[] = ['nixl_cu12', 'nixl_cu13']

export const defaultCacheDir = join(packageRoot, '.cache', 'nixl')

function variantOf(libDir: string): NixlVariant | null {
  const m = /^\.(nixl_cu1[23])\.mesonpy\.libs$/.exec(basename(libDir))
  return m ? (m[1] as NixlVariant) : null
}

/**
 * The version from the dist-info folder beside the library folder (installed site-packages or
 * an unzipped wheel look the same). No C API call reports it in v1.0–v1.5.
 */
export function versionNear(libDir: string, variant: NixlVariant | null): string | null {
  const parent = dirname(libDir)
  let names: string[]
  try {
    names = readdirSync(parent)
  } catch {
    return null
  }
  const wanted = variant ? [variant] : VARIANTS
  for (const v of wanted) {
    const re = new RegExp(`^${v}-([0-9][^-]*)\\.dist-info$`)
    for (const n of names) {
      const m = re.exec(n)
      if (m?.[1]) return m[1]
    }
  }
  return null
}

function fromDir(libDir: string, source: NixlLocation['source']): NixlLocation {
  const variant = variantOf(libDir)
  return { libDir, source, variant, version: versionNear(libDir, variant) }
}

function order(cudaMajor: number | null | undefined): NixlVariant[] {
  return cudaMajor === 13 ? ['nixl_cu13', 'nixl_cu12'] : ['nixl_cu12', 'nixl_cu13']
}

// One interpreter start for both variants: find_spec locates a package without importing it
// (importing would pull torch in).
const FIND_SPEC = [
  'import importlib.util, os, sys',
  'for n in sys.argv[1:]:',
  '    s = importlib.util.find_spec(n)',
  '    o = s.submodule_search_locations[0] if s and s.submodule_search_locations else None',
  '    print(n + "=" + (os.path.join(os.path.dirname(o), "." + n + ".mesonpy.libs") if o else ""))',
].join('\n')

async function fromPython(python: string, variants: NixlVariant[]): Promise<NixlLocation | null> {
  let stdout: string
  try {
    ;({ stdout } = await execFileAsync(python, ['-c', FIND_SPEC, ...variants], { timeout: 10_000 }))
  } catch {
    return null // no python, or it failed: not an error, just not this source
  }
  const found = new Map<string, string>()
  for (const line of stdout.split('\n')) {
    const eq = line.indexOf('=')
    if (eq > 0 && line.length > eq + 1) found.set(line.slice(0, eq), line.slice(eq + 1))
  }
  for (const v of variants) {
    const dir = found.get(v)
    if (dir && existsSync(join(dir, 'libnixl_capi.so'))) return fromDir(dir, 'python')
  }
  return null
}

function compareVersions(a: string, b: string): number {
  const pa = a.split(/[.+-]/).map((x) => Number.parseInt(x, 10) || 0)
  const pb = b.split(/[.+-]/).map((x) => Number.parseInt(x, 10) || 0)
  for (let i = 0; i < Math.max(pa.length, pb.length); i++) {
    const d = (pa[i] ?? 0) - (pb[i] ?? 0)
    if (d !== 0) return d
  }
  return 0
}

/** The newest unzipped wheel under the cache, of the preferred variant first. */
export function fromCache(cacheDir: string, variants: readonly NixlVariant[] = VARIANTS): NixlLocation | null {
  let entries: string[]
  try {
    entries = readdirSync(cacheDir)
  } catch {
    return null
  }
  for (const v of variants) {
    const hits = entries
      .map((e) => ({ e, m: new RegExp(`^${v}-([0-9][^-]*)$`).exec(e) }))
      .filter((x) => x.m !== null && existsSync(join(cacheDir, x.e, `.${v}.mesonpy.libs`, 'libnixl_capi.so')))
      .sort((x, y) => compareVersions(y.m?.[1] ?? '0', x.m?.[1] ?? '0'))
    const best = hits[0]
    if (best) return fromDir(join(cacheDir, best.e, `.${v}.mesonpy.libs`), 'cache')
  }
  return null
}

/**
 * Finds NIXL's library directory: NIXL_LIB_DIR (taken as given, even when it holds nothing,
 * so a wrong setting fails loudly at load instead of silently using another copy), then an
 * installed nixl_cu12/nixl_cu13 Python package, then the fetch script's cache.
 */
export async function locateNixl(opts: LocateOptions = {}): Promise<NixlLocation | null> {
  if (opts.libDir) return fromDir(opts.libDir, 'NIXL_LIB_DIR')
  const variants = order(opts.cudaMajor)
  const python = opts.python === undefined ? 'python3' : opts.python
  if (python !== null) {
    const hit = await fromPython(python, variants)
    if (hit) return hit
  }
  return fromCache(opts.cacheDir ?? defaultCacheDir, variants)
}
