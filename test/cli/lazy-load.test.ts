import { spawnSync } from 'node:child_process'
import { mkdtempSync, readFileSync, rmSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { dirname, join } from 'node:path'
import { fileURLToPath, pathToFileURL } from 'node:url'
import t, { type Test } from 'tap'
import { cliEntry, packageRoot } from '../../common/paths.js'
import { spawnService } from '../../common/spawn.js'

/*
 * Issue 18 item 5: `handoff router --help` took 1.5 s and 144 MB, because the whole graph,
 * the Kubernetes client included, loaded before anything ran. Asserted as behaviour, not time:
 * which modules a command loads. A module-resolution hook logs the files the process resolves;
 * the CLI is a bundle (scripts/bundle.mjs), so each chunk it loads stands for the modules
 * esbuild put in it (dist/bundle-meta.json). Discovery's Kubernetes client loads only when
 * discovery is configured.
 */

const hook = join(dirname(fileURLToPath(import.meta.url)), 'fixtures', 'log-loads.mjs')

/** What each bundle file holds: its URL → the absolute paths of the modules in it. */
const chunks = new Map<string, string[]>()
const meta = JSON.parse(readFileSync(join(packageRoot, 'dist', 'bundle-meta.json'), 'utf8')) as { outputs: Record<string, { inputs: Record<string, unknown> }> }
for (const [output, { inputs }] of Object.entries(meta.outputs)) {
  chunks.set(pathToFileURL(join(packageRoot, output)).href, Object.keys(inputs).map((i) => join(packageRoot, i)))
}

/** The modules a log of resolved URLs stands for: a bundle file's modules, or the file itself. */
function modulesOf(log: string): string[] {
  let urls: string[] = []
  try {
    urls = readFileSync(log, 'utf8').split('\n').filter(Boolean)
  } catch {
    // nothing resolved at all
  }
  return urls.flatMap((u) => chunks.get(u) ?? [u])
}

function logFile(t: Test): string {
  const dir = mkdtempSync(join(tmpdir(), 'handoff-loads-'))
  t.teardown(() => rmSync(dir, { recursive: true, force: true }))
  return join(dir, 'loads.txt')
}

function loads(t: Test, args: string[]): { status: number | null; stdout: string; modules: string[] } {
  const log = logFile(t)
  const run = spawnSync(process.execPath, ['--import', hook, cliEntry, ...args], { encoding: 'utf8', timeout: 30_000, env: { ...process.env, HANDOFF_LOAD_LOG: log } })
  return { status: run.status, stdout: run.stdout, modules: modulesOf(log) }
}

const kubernetes = (m: string): boolean => m.includes('@kubernetes/client-node') || m.endsWith('/discovery/kubernetes.js')

t.test('handoff router --help loads neither the router app nor the Kubernetes client', async (t) => {
  const r = loads(t, ['router', '--help'])
  t.equal(r.status, 0)
  t.match(r.stdout, /^usage: handoff router/)
  t.ok(r.modules.length > 0, `the hook saw the modules it loaded (${r.modules.length})`)
  t.same(r.modules.filter(kubernetes), [], 'no Kubernetes client')
  t.same(r.modules.filter((m) => m.endsWith('/router/src/app.js') || m.includes('/node_modules/fastify/')), [], 'no router app, no fastify')
})

t.test('a bench --help, and the router app itself, load the Kubernetes client only when discovery is configured', async (t) => {
  const r = loads(t, ['bench', 'events', '--help'])
  t.equal(r.status, 0)
  t.ok(r.modules.some((m) => m.endsWith('/router/src/app.js')), 'this bench builds router apps, so it loads the app')
  t.same(r.modules.filter(kubernetes), [], 'but not the Kubernetes client')
})

t.test('a router with the memory store loads no Redis client', async (t) => {
  // `handoff router` with the default (memory) store, up and serving, then stopped.
  const log = logFile(t)
  const router = await spawnService({ args: ['router', '--port', '0', '--log-level', 'warn'], env: { ...process.env, NODE_OPTIONS: `--import=${hook}`, HANDOFF_LOAD_LOG: log } })
  t.equal(await router.stop(), 0, 'served, then stopped cleanly')
  const modules = modulesOf(log)
  t.ok(modules.some((m) => m.endsWith('/router/src/app.js')), 'the router app loaded')
  t.same(modules.filter((m) => m.includes('/node_modules/ioredis/') || m.endsWith('/store/redis-store.js')), [], 'no ioredis, no Redis store')
  t.same(modules.filter(kubernetes), [], 'no Kubernetes client')
})

t.test('the bundle holds the modules these cases look for, so the cases can fail', async (t) => {
  const all = [...chunks.values()].flat()
  for (const m of ['/router/src/app.js', '/store/redis-store.js', '/discovery/kubernetes.js']) t.ok(all.some((i) => i.endsWith(m)), m)
  t.ok(all.some((i) => i.includes('/node_modules/fastify/')), 'fastify')
  t.ok(all.some((i) => i.includes('/node_modules/ioredis/')), 'ioredis')
  t.ok(all.some((i) => i.includes('/node_modules/@kubernetes/client-node/')), 'the Kubernetes client')
})
