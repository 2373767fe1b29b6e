import { mkdtempSync, readdirSync, readFileSync, rmSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { dirname, join, relative, resolve } from 'node:path'
import t from 'tap'
import { packageRoot } from '../../common/paths.js'

/*
 * No module imports itself through others (issue 39: topology's registry, candidates and
 * selection once did), type-only imports included: a circle means neither side can be read,
 * tested or moved alone. Relative imports only; what a package imports is its own affair.
 * esbuild's metafile (dist/bundle-meta.json) cannot tell: it drops type-only imports.
 */

const FOLDERS = ['router/src', 'transfer-agent/src', 'sim/src', 'common', 'schemas', 'native', 'bench', 'cli']

function sources(dir: string): string[] {
  return readdirSync(dir, { withFileTypes: true }).flatMap((e) => {
    const p = join(dir, e.name)
    if (e.isDirectory()) return e.name === 'node_modules' || e.name === 'build' ? [] : sources(p)
    return e.name.endsWith('.ts') && !e.name.endsWith('.d.ts') ? [p] : []
  })
}

/** Every circle of relative imports, each once, as `a -> b -> a`. */
function circles(files: readonly string[]): string[] {
  const known = new Set(files)
  const edges = new Map<string, string[]>()
  for (const f of files) {
    const text = readFileSync(f, 'utf8')
    const deps = [...text.matchAll(/(?:from|import)\s+'(\.{1,2}\/[^']+)\.js'/g)].map((m) => resolve(dirname(f), `${m[1]}.ts`))
    edges.set(f, [...new Set(deps.filter((d) => known.has(d)))])
  }
  const found = new Set<string>()
  const state = new Map<string, 'open' | 'done'>()
  const path: string[] = []
  const visit = (n: string): void => {
    state.set(n, 'open')
    path.push(n)
    for (const m of edges.get(n) ?? []) {
      if (state.get(m) === 'open') found.add([...path.slice(path.indexOf(m)), m].map((p) => relative(packageRoot, p)).join(' -> '))
      else if (!state.has(m)) visit(m)
    }
    path.pop()
    state.set(n, 'done')
  }
  for (const f of files) if (!state.has(f)) visit(f)
  return [...found]
}

t.test('no import circles in the production code', async (t) => {
  const files = FOLDERS.flatMap((d) => sources(join(packageRoot, d)))
  t.ok(files.length > 100, `${files.length} modules read`)
  t.same(circles(files), [], 'no circle')
})

t.test('the check finds a circle, type-only imports included', async (t) => {
  const fixture = join(packageRoot, 'router/src/topology')
  const files = ['registry.ts', 'candidates.ts', 'selection.ts', 'views.ts'].map((f) => join(fixture, f))
  t.same(circles(files), [], 'the topology modules today')
  // What selection.ts imported before the views were split out of the registry.
  const dir = mkdtempSync(join(tmpdir(), 'handoff-cycles-'))
  t.teardown(() => rmSync(dir, { recursive: true, force: true }))
  writeFileSync(join(dir, 'a.ts'), "import { b } from './b.js'\n")
  writeFileSync(join(dir, 'b.ts'), "import type { A } from './a.js'\n")
  t.same(circles([join(dir, 'a.ts'), join(dir, 'b.ts')]).length, 1, 'a type-only import back is a circle')
})
