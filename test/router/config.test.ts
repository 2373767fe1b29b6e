import { mkdtempSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import t from 'tap'
import { loadConfig } from '../../router/src/config.js'

function file(content: string): string {
  const dir = mkdtempSync(join(tmpdir(), 'handoff-cfg-'))
  const f = join(dir, 'router.json')
  writeFileSync(f, content)
  return f
}

t.test('schema defaults fill an empty config, and the result is frozen', async (t) => {
  const c = loadConfig()
  t.equal(c.port, 8000)
  t.equal(c.host, '127.0.0.1')
  t.equal(c.timeouts.prefillMs, 120000)
  t.equal(c.pairing.mode, 'all')
  t.same(c.instances, [])
  t.ok(Object.isFrozen(c) && Object.isFrozen(c.timeouts))
})

t.test('beyond loopback the router needs an agent token (issue 18 item 2)', async (t) => {
  for (const host of ['0.0.0.0', '10.1.2.3', '::']) {
    t.throws(() => loadConfig({ overrides: { host } }), { code: 'RTR_ERR_CONFIG', message: new RegExp(`listens on ${host.replace(/\./g, '\\.')}, beyond loopback, without an agent token`) }, host)
    t.equal(loadConfig({ overrides: { host }, env: { HANDOFF_AGENT_TOKEN: 'agent-token-1' } }).host, host)
  }
  for (const host of ['127.0.0.1', '127.0.0.2', 'localhost', '::1']) t.equal(loadConfig({ overrides: { host } }).host, host, `${host}: loopback, open is fine`)
})

t.test('precedence: flags over env over file', async (t) => {
  const f = file(JSON.stringify({ port: 9001, host: '0.0.0.0', agentToken: 'agent-token-1', instances: [{ id: 'p0', role: 'prefill', url: 'http://127.0.0.1:1' }] }))
  t.equal(loadConfig({ file: f }).port, 9001)
  t.equal(loadConfig({ file: f, env: { HANDOFF_PORT: '9002' } }).port, 9002)
  t.equal(loadConfig({ file: f, env: { HANDOFF_PORT: '9002' }, overrides: { port: 9003 } }).port, 9003)
  // Issue 22 defect 1: a Kubernetes service link for a Service named `handoff` is not a port.
  const warnings: string[] = []
  t.equal(loadConfig({ file: f, env: { HANDOFF_PORT: 'tcp://10.96.0.12:8000' }, onWarning: (m) => warnings.push(m) }).port, 9001, "a service link is ignored: the file's port")
  t.match(warnings, [/HANDOFF_PORT=tcp:\/\/10\.96\.0\.12:8000 ignored: it is a Kubernetes service link/])
  const env = loadConfig({
    env: {
      HANDOFF_API_KEYS: 'key-one-123, key-two-456',
      HANDOFF_INSTANCES: '[{"id":"d0","role":"decode","url":"http://127.0.0.1:2"}]',
      HANDOFF_ADMIN_TOKEN: 'admin-token-1',
    },
  })
  t.same(env.apiKeys, ['key-one-123', 'key-two-456'])
  t.equal(env.instances[0]?.id, 'd0')
  t.equal(env.adminToken, 'admin-token-1')
})

t.test('bad configs fail fast with RTR_ERR_CONFIG and say why', async (t) => {
  const cases: [() => unknown, RegExp][] = [
    [() => loadConfig({ file: '/nonexistent/router.json' }), /cannot read/],
    [() => loadConfig({ file: file('{nope') }), /not valid JSON/],
    [() => loadConfig({ file: file('[]') }), /top level must be an object/],
    [() => loadConfig({ file: file('{"port": 70000}') }), /\/port must be <= 65535/],
    [() => loadConfig({ file: file('{"surprise": 1}') }), /: \/ has an unknown key "surprise"$/],
    [() => loadConfig({ file: file('{"instances":[{"id":"x","role":"leader","url":"http://a"}]}') }), /role/],
    [() => loadConfig({ file: file('{"instances":[{"id":"x","role":"decode","url":"ftp://a"}]}') }), /url/],
    [
      () =>
        loadConfig({
          file: file('{"instances":[{"id":"x","role":"decode","url":"http://a"},{"id":"x","role":"decode","url":"http://b"}]}'),
        }),
      /duplicate instance id x/,
    ],
    [() => loadConfig({ env: { HANDOFF_INSTANCES: 'not json' } }), /HANDOFF_INSTANCES/],
    [() => loadConfig({ env: { HANDOFF_PORT: 'eighty' } }), /port/],
  ]
  for (const [fn, msg] of cases) t.throws(fn, { code: 'RTR_ERR_CONFIG', message: msg })
})

// Issue 40 item 2: an error names the bad value, what is allowed and the unknown key, once.
t.test('validation errors say what to fix, each once', async (t) => {
  const message = (json: string): string => {
    try {
      loadConfig({ file: file(json) })
      return ''
    } catch (err) {
      return (err as Error).message.replace(/^invalid router configuration: /, '')
    }
  }
  t.equal(
    message('{"instances":[{"id":"x","role":"prefil","url":"http://a"}]}'),
    '/instances/0/role must be one of "prefill", "decode", "both" (got "prefil")',
    'a misspelt role: the allowed values and the value given, in one line',
  )
  t.equal(message('{"timeouts":{"prefilMs":1000}}'), '/timeouts has an unknown key "prefilMs" (did you mean "prefillMs"?)', 'a misspelt key: the key, and the nearest known one')
  t.equal(message('{"timeouts":{"zzzzzz":1}}'), '/timeouts has an unknown key "zzzzzz"', 'no known key near it: no guess')
  t.equal(message('{"port": 70000}'), '/port must be <= 65535 (got 70000)', 'a bound: the value given')
})

t.test('the example deployment config is valid', async (t) => {
  const { packageRoot } = await import('../../common/paths.js')
  const file = join(packageRoot, 'deploy', 'router.example.json')
  t.throws(() => loadConfig({ file }), { code: 'RTR_ERR_CONFIG', message: /beyond loopback/ }, 'on 0.0.0.0 it needs the agent token')
  const c = loadConfig({ file, env: { HANDOFF_AGENT_TOKEN: 'agent-token-example' } })
  t.equal(c.instances.length, 3)
  t.equal(c.pairing.mode, 'label')
})

t.test('leases.leaseSeconds: from the file, HANDOFF_LEASE_SECONDS or --lease-seconds, keeping the file\'s other lease settings', async (t) => {
  t.equal(loadConfig().leases.leaseSeconds, 30)
  const f = file(JSON.stringify({ leases: { leaseSeconds: 20, marginMs: 500 } }))
  t.same([loadConfig({ file: f }).leases.leaseSeconds, loadConfig({ file: f }).leases.marginMs], [20, 500])
  const fromEnv = loadConfig({ file: f, env: { HANDOFF_LEASE_SECONDS: '5' } })
  t.same([fromEnv.leases.leaseSeconds, fromEnv.leases.marginMs, fromEnv.leases.onLapsed], [5, 500, 'reprefill'])
  t.equal(loadConfig({ file: f, env: { HANDOFF_LEASE_SECONDS: '5' }, overrides: { leaseSeconds: 7 } }).leases.leaseSeconds, 7, 'the flag wins')
  t.throws(() => loadConfig({ env: { HANDOFF_LEASE_SECONDS: 'soon' } }), { code: 'RTR_ERR_CONFIG', message: /leaseSeconds/ })
  t.throws(() => loadConfig({ overrides: { leaseSeconds: 1 } }), { code: 'RTR_ERR_CONFIG', message: /marginMs \(1000\) must be below the lease/ })
})

t.test('store: memory by default; a redis:// URL from env or --store keeps the file\'s other store settings', async (t) => {
  t.same(loadConfig().store, { kind: 'memory', prefix: 'handoff:', memberTtlMs: 3000, commandTimeoutMs: 1000 })
  const f = file(JSON.stringify({ store: { kind: 'memory', prefix: 'fleet-a:' } }))
  const fromEnv = loadConfig({ file: f, env: { HANDOFF_STORE: 'redis://127.0.0.1:6390' } })
  t.same([fromEnv.store.kind, fromEnv.store.url, fromEnv.store.prefix], ['redis', 'redis://127.0.0.1:6390', 'fleet-a:'])
  const fromFlag = loadConfig({ file: f, env: { HANDOFF_STORE: 'redis://127.0.0.1:6390' }, overrides: { store: 'memory' } })
  t.same([fromFlag.store.kind, fromFlag.store.prefix], ['memory', 'fleet-a:'])
  t.throws(() => loadConfig({ overrides: { store: 'mysql://x' } }), { code: 'RTR_ERR_CONFIG', message: /store must be 'memory', a redis:\/\/ URL or a redis\+sentinel:\/\/ one/ })
  t.throws(() => loadConfig({ overrides: { store: 'redi://:hunter2@x' } }), { code: 'RTR_ERR_CONFIG', message: /got 'redi:\/\/…'$/ }, 'a password in a mistyped URL is not echoed')
  const sentinel = 'redis+sentinel://:pw@10.0.0.1:26379,10.0.0.2:26379/mymaster/1'
  t.same(loadConfig({ env: { HANDOFF_STORE: sentinel } }).store.url, sentinel, 'through Sentinel (issue 21 item 7)')
  t.equal(loadConfig({ file: file(JSON.stringify({ store: { kind: 'redis', url: sentinel } })) }).store.url, sentinel)
  t.throws(() => loadConfig({ file: file('{"store":{"kind":"redis"}}') }), { code: 'RTR_ERR_CONFIG', message: /needs store.url/ })
  t.throws(() => loadConfig({ file: file('{"store":{"kind":"redis","url":"http://x"}}') }), { code: 'RTR_ERR_CONFIG', message: /url/ })
})

t.test('discovery: kubernetes with at least one role; absent means static config only', async (t) => {
  t.equal(loadConfig().discovery, undefined)
  const c = loadConfig({ file: file(JSON.stringify({ discovery: { kind: 'kubernetes', namespace: 'llm', prefill: { selector: 'role=prefill', port: 8000 } } })) })
  t.match(c.discovery, { kind: 'kubernetes', namespace: 'llm', prefill: { selector: 'role=prefill', port: 8000 }, backoffMs: 500, maxBackoffMs: 30000 })
  t.throws(() => loadConfig({ file: file('{"discovery":{"kind":"kubernetes","namespace":"llm"}}') }), { code: 'RTR_ERR_CONFIG', message: /at least one of prefill, decode, both/ })
  t.throws(() => loadConfig({ file: file('{"discovery":{"kind":"consul","namespace":"llm","both":{"selector":"a=b","port":1}}}') }), { code: 'RTR_ERR_CONFIG' })
  t.throws(() => loadConfig({ file: file('{"discovery":{"kind":"kubernetes","namespace":"Not_A_Namespace","both":{"selector":"a=b","port":1}}}') }), { code: 'RTR_ERR_CONFIG', message: /namespace/ })
})
