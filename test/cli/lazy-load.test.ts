import { spawnSync } from 'node:child_process'
import { mkdtempSync, readFileSync, rmSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { dirname, join } from 'node:path'
import { fileURLToPath } from 'node:url'
import t, { type Test } from 'tap'
import { cliEntry } from '../../common/paths.js'

/*
 * Issue 18 item 5: `handoff router --help` took 1.5 s and 144 MB, because the whole graph,
 * the Kubernetes client included, loaded before anything ran. Asserted as behaviour, not time:
 * which modules a command resolves (a module-resolution hook logs them). Discovery's
 * Kubernetes client loads only when discovery is configured.
 */

const hook = join(dirname(fileURLToPath(import.meta.url)), 'fixtures', 'log-loads.mjs')

function loads(t: Test, args: string[], entry: string[] = [cliEntry]): { status: number | null; stdout: string; modules: string[] } {
  const dir = mkdtempSync(join(tmpdir(), 'handoff-loads-'))
  t.teardown(() => rmSync(dir, { recursive: true, force: true }))
  const log = join(dir, 'loads.txt')
  const run = spawnSync(process.execPath, ['--import', hook, ...entry, ...args], { encoding: 'utf8', timeout: 30_000, env: { ...process.env, HANDOFF_LOAD_LOG: log } })
  let modules: string[] = []
  try {
    modules = readFileSync(log, 'utf8').split('\n').filter(Boolean)
  } catch {
    // nothing resolved at all
  }
  return { status: run.status, stdout: run.stdout, modules }
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
  // The router app as `handoff router` builds it, with the default (memory) store, then closed.
  const app = new URL('../router/src/app.js', `file://${cliEntry}`).href
  const config = new URL('../router/src/config.js', `file://${cliEntry}`).href
  const script = `const { buildApp } = await import(${JSON.stringify(app)}); const { loadConfig } = await import(${JSON.stringify(config)});
    const a = await buildApp({ config: loadConfig({ overrides: { port: 0, logLevel: 'warn' } }), probe: false }); await a.ready(); await a.close(); console.log('built')`
  const r = loads(t, [], ['--input-type=module', '-e', script])
  t.equal(r.status, 0)
  t.match(r.stdout, /built/)
  t.ok(r.modules.some((m) => m.endsWith('/router/src/app.js')), 'the router app loaded')
  t.same(r.modules.filter((m) => m.includes('/node_modules/ioredis/') || m.endsWith('/store/redis-store.js')), [], 'no ioredis, no Redis store')
  t.same(r.modules.filter(kubernetes), [], 'no Kubernetes client')
})
