import { mkdtempSync, rmSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { dirname, join, resolve } from 'node:path'
import { fileURLToPath } from 'node:url'
import t from 'tap'
import { loadConfig } from '../../router/src/config.js'
import { needKube, startKube } from '../helpers/kube.js'

// Issue 11: the chart renders, lints clean, is accepted by a real API server
// (`kubectl apply --dry-run=server`), configures a router its own config loader accepts, and
// its RBAC grants discovery exactly what it needs.

const chart = resolve(dirname(fileURLToPath(import.meta.url)), '../../deploy/helm/handoff')
const ADMIN = ['--set', 'secrets.adminToken=admin-token-for-tests', '--set', 'secrets.agentToken=agent-token-for-tests', '--set', 'secrets.drainToken=drain-token-for-tests']

interface K8sObject {
  kind: string
  metadata: { name: string; namespace?: string }
  data?: Record<string, string>
}

t.test('the Helm chart against a real API server', { skip: needKube(t, { helm: true }) }, async (t) => {
  const kube = await startKube(t)
  const dir = mkdtempSync(join(tmpdir(), 'handoff-chart-'))
  t.teardown(() => rmSync(dir, { recursive: true, force: true }))

  t.test('helm lint --strict is clean', async (t) => {
    const { stdout } = await kube.helm(['lint', chart, '--strict', ...ADMIN])
    t.match(stdout, /1 chart\(s\) linted, 0 chart\(s\) failed/)
    t.notMatch(stdout, /\[(WARNING|ERROR)\]/)
  })

  t.test('the rendered chart is valid for the API server, and so is the router config in it', async (t) => {
    const ns = 'chart-llm'
    await kube.createNamespace(ns)
    const file = join(dir, 'rendered.yaml')
    writeFileSync(file, (await kube.helm(['template', 'r', chart, '--namespace', ns, ...ADMIN, '--set', 'secrets.apiKeys={key-one-123,key-two-456}'])).stdout)
    const { stdout } = await kube.kubectl(['apply', '--dry-run=server', '-n', ns, '-f', file, '-o', 'json'])
    const items = (JSON.parse(stdout) as { items?: K8sObject[] } & K8sObject).items ?? []
    t.same(
      items.map((i) => i.kind).sort(),
      // The second ConfigMap: the engines' preStop drain script (engines.drain.configMap).
      ['ConfigMap', 'ConfigMap', 'Deployment', 'NetworkPolicy', 'PodDisruptionBudget', 'Role', 'RoleBinding', 'Secret', 'Service', 'Service', 'ServiceAccount'],
      'every object accepted by the API server',
    )
    const routerJson = items.find((i) => i.kind === 'ConfigMap' && i.metadata.name === 'r-handoff')?.data?.['router.json']
    t.ok(routerJson, 'the ConfigMap holds router.json')
    const cfgFile = join(dir, 'router.json')
    writeFileSync(cfgFile, routerJson ?? '')
    // The Secret's HANDOFF_* variables come with it: the router listens on 0.0.0.0 and refuses to without the agent token.
    t.throws(() => loadConfig({ file: cfgFile }), { code: 'RTR_ERR_CONFIG', message: /beyond loopback, without an agent token/ })
    const config = loadConfig({ file: cfgFile, env: { HANDOFF_AGENT_TOKEN: 'agent-token-for-tests' } })
    t.match(config, { host: '0.0.0.0', port: 8000, discovery: { kind: 'kubernetes', namespace: ns, prefill: { port: 8000 }, decode: { port: 8000 } } })
    t.equal(config.discovery?.both, undefined)
  })

  t.test('its RBAC lets the router get, list and watch pods, and nothing else', async (t) => {
    const ns = 'chart-rbac'
    await kube.createNamespace(ns)
    const file = join(dir, 'rbac.yaml')
    writeFileSync(file, (await kube.helm(['template', 'r', chart, '--namespace', ns, ...ADMIN, '--show-only', 'templates/serviceaccount.yaml', '--show-only', 'templates/rbac.yaml'])).stdout)
    await kube.kubectl(['apply', '-n', ns, '-f', file])
    // `kubectl auth can-i` exits 1 on "no".
    const can = async (verb: string, resource: string, where = ns): Promise<boolean> => {
      const res = await kube.kubectl(['auth', 'can-i', verb, resource, '-n', where, `--as=system:serviceaccount:${ns}:r-handoff`]).catch((e: { stdout?: string }) => ({ stdout: e.stdout ?? '' }))
      return res.stdout.trim() === 'yes'
    }
    for (const verb of ['get', 'list', 'watch']) t.ok(await can(verb, 'pods'), `${verb} pods`)
    t.notOk(await can('create', 'pods'), 'no create pods')
    t.notOk(await can('list', 'secrets'), 'no secrets')
    t.notOk(await can('list', 'pods', 'default'), 'no pods in another namespace')
  })

  t.test('bad values fail at render time with the reason', async (t) => {
    const fails = async (args: string[]): Promise<string> =>
      kube.helm(['template', 'r', chart, ...args]).then(
        () => '',
        (e: { stderr?: string }) => e.stderr ?? '',
      )
    t.match(await fails([]), /secrets\.adminToken is required/)
    t.match(await fails(['--set', 'secrets.adminToken=admin-token-for-tests']), /secrets\.drainToken is required/)
    t.match(await fails(['--set', 'secrets.adminToken=admin-token-for-tests', '--set', 'secrets.drainToken=drain-token-for-tests']), /secrets\.agentToken is required/)
    t.match(await fails(['--set', 'secrets.adminToken=admin-token-for-tests', '--set', 'secrets.agentToken=agent-token-for-tests', '--set', 'secrets.drainToken=admin-token-for-tests']), /secrets\.drainToken must differ/)
    t.match(await fails([...ADMIN, '--set', 'router.replicas=2']), /router\.replicas > 1 needs store\.redisUrl/)
    t.match(await fails([...ADMIN, '--set', 'router.terminationGracePeriodSeconds=10']), /shutdownGraceMs must stay below/)
    t.equal(await fails([...ADMIN, '--set', 'router.replicas=2', '--set', 'store.redisUrl=redis://redis:6379']), '', 'two replicas on Redis render')
  })
})
