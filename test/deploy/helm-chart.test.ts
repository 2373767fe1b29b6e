import { mkdtempSync, rmSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { dirname, join, resolve } from 'node:path'
import { fileURLToPath } from 'node:url'
import t from 'tap'
import { freePort } from '../../common/ports.js'
import { ROUTER_NODE_ARGS } from '../../common/node-args.js'
import { spawnService } from '../../common/spawn.js'
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

interface PodOwner extends K8sObject {
  spec?: { template?: { spec?: { enableServiceLinks?: boolean } }; ports?: { name?: string; port: number }[] }
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
      // No PodDisruptionBudget for the one replica of the defaults: minAvailable 1 would block every node drain.
      ['ConfigMap', 'ConfigMap', 'Deployment', 'NetworkPolicy', 'Role', 'RoleBinding', 'Secret', 'Service', 'Service', 'ServiceAccount'],
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

  // Issue 22 defect 1: for the documented release name `handoff` the client Service is
  // `handoff`, and a kubelet injects HANDOFF_PORT=tcp://<ClusterIP>:8000 into every pod of the
  // namespace (service links). The router read it as its port and crash-looped.
  t.test('release `handoff`: the router starts with the service links a kubelet injects for every Service of the chart', async (t) => {
    const ns = 'chart-links'
    await kube.createNamespace(ns)
    const file = join(dir, 'links.yaml')
    writeFileSync(file, (await kube.helm(['template', 'handoff', chart, '--namespace', ns, ...ADMIN])).stdout)
    const { stdout } = await kube.kubectl(['apply', '--dry-run=server', '-n', ns, '-f', file, '-o', 'json'])
    const items = (JSON.parse(stdout) as { items?: PodOwner[] } & PodOwner).items ?? []
    for (const i of items.filter((x) => x.spec?.template)) t.equal(i.spec?.template?.spec?.enableServiceLinks, false, `${i.kind} ${i.metadata.name}: no service links in its pods`)
    // What a kubelet would inject anyway (a pod that did not opt out, an older chart's pods).
    const env: NodeJS.ProcessEnv = { HANDOFF_AGENT_TOKEN: 'agent-token-for-tests' }
    items
      .filter((i) => i.kind === 'Service')
      .forEach((svc, n) => {
        const name = svc.metadata.name.toUpperCase().replace(/-/g, '_')
        const ip = `10.96.0.${10 + n}`
        const ports = svc.spec?.ports ?? []
        const first = ports[0]
        if (!first) return
        Object.assign(env, { [`${name}_SERVICE_HOST`]: ip, [`${name}_SERVICE_PORT`]: String(first.port), [`${name}_PORT`]: `tcp://${ip}:${first.port}` })
        for (const p of ports) {
          const key = `${name}_PORT_${p.port}_TCP`
          Object.assign(env, { [key]: `tcp://${ip}:${p.port}`, [`${key}_PROTO`]: 'tcp', [`${key}_PORT`]: String(p.port), [`${key}_ADDR`]: ip })
          if (p.name) env[`${name}_SERVICE_PORT_${p.name.toUpperCase().replace(/-/g, '_')}`] = String(p.port)
        }
      })
    t.match(env.HANDOFF_PORT, /^tcp:\/\/10\.96\.0\.\d+:8000$/, 'the client Service `handoff` makes HANDOFF_PORT')
    // The chart's router.json, on free loopback ports and without discovery (no API server for it here).
    const cm = items.find((i) => i.kind === 'ConfigMap' && i.metadata.name === 'handoff')?.data?.['router.json'] ?? '{}'
    const { discovery: _discovery, ...config } = JSON.parse(cm) as Record<string, unknown>
    const cfgFile = join(dir, 'links-router.json')
    writeFileSync(cfgFile, JSON.stringify({ ...config, host: '127.0.0.1', port: await freePort(), adminPort: await freePort(), agentPort: await freePort() }))
    const router = await spawnService({ args: ['router', '--config', cfgFile], env: { PATH: process.env.PATH, ...env } })
    t.teardown(() => router.stop())
    t.ok(router.url, `the router started (${router.url})`)
    t.match(router.output(), /HANDOFF_PORT.*service link/, 'and said it ignored HANDOFF_PORT')
  })

  // Issue 22 defect 5: a budget of minAvailable 1 over one replica blocks every node drain.
  t.test('a PodDisruptionBudget only for two routers or more', async (t) => {
    const kinds = async (args: string[]): Promise<string> => (await kube.helm(['template', 'r', chart, ...ADMIN, ...args])).stdout
    t.notMatch(await kinds([]), /kind: PodDisruptionBudget/, 'one router: none')
    t.match(await kinds(['--set', 'router.replicas=2', '--set', 'store.redisUrl=redis://redis:6379']), /kind: PodDisruptionBudget/, 'two routers: minAvailable 1')
  })

  // Issue 22 defect 2: only the ConfigMap was checksummed; a rotated token left the routers on
  // the old one while the engines' mounted drain token changed, and every preStop got 401.
  t.test('a rotated Secret rolls the routers', async (t) => {
    const podAnnotations = async (args: string[]): Promise<Record<string, string>> => {
      const { stdout } = await kube.helm(['template', 'r', chart, '--show-only', 'templates/deployment.yaml', ...ADMIN, ...args])
      return Object.fromEntries([...stdout.matchAll(/^\s+(checksum\/\w+): (\S+)$/gm)].map((m) => [m[1] as string, m[2] as string]))
    }
    const before = await podAnnotations([])
    t.match(before, { 'checksum/config': /^[0-9a-f]{64}$/, 'checksum/secret': /^[0-9a-f]{64}$/ }, 'the router pods carry both checksums')
    const rotated = await podAnnotations(['--set', 'secrets.drainToken=drain-token-rotated'])
    t.equal(rotated['checksum/config'], before['checksum/config'], 'the config is the same')
    t.not(rotated['checksum/secret'], before['checksum/secret'], 'a new drain token changes the pod template')
    t.not((await podAnnotations(['--set', 'secrets.adminToken=admin-token-rotated']))['checksum/secret'], before['checksum/secret'], 'so does a new admin token')
  })

  t.test('the router container runs node with the router’s own flags (common/node-args.ts)', async (t) => {
    const { stdout } = await kube.helm(['template', 'r', chart, '--show-only', 'templates/deployment.yaml', ...ADMIN])
    const command = /command: (\[.*"router".*\])/.exec(stdout)?.[1]
    t.ok(command, 'the router’s command')
    t.same(JSON.parse(command ?? '[]').slice(0, 1 + ROUTER_NODE_ARGS.length + 2), ['node', ...ROUTER_NODE_ARGS, 'dist/handoff.js', 'router'])
  })

  // Issue 22 defect 5: nothing kept the routers off one node.
  t.test('routers are spread over nodes and zones', async (t) => {
    const { stdout } = await kube.helm(['template', 'r', chart, '--show-only', 'templates/deployment.yaml', ...ADMIN])
    t.match(stdout, /topologySpreadConstraints:\n\s+- maxSkew: 1\n\s+topologyKey: kubernetes\.io\/hostname\n\s+whenUnsatisfiable: ScheduleAnyway/, 'over nodes, never blocking scheduling')
    t.match(stdout, /topologyKey: topology\.kubernetes\.io\/zone/, 'and zones')
    t.match(stdout, /labelSelector:\n\s+matchLabels:\n\s+app\.kubernetes\.io\/name: handoff\n\s+app\.kubernetes\.io\/instance: r\n\s+app\.kubernetes\.io\/component: router/, 'counting this release’s routers')
    const off = await kube.helm(['template', 'r', chart, '--show-only', 'templates/deployment.yaml', ...ADMIN, '--set', 'router.spread=false'])
    t.notMatch(off.stdout, /topologySpreadConstraints/, 'router.spread=false: none')
  })

  // Issue 22: Redis for several routers, bundled or through Sentinel, wired to the store URL.
  t.test('several routers on the bundled Redis or on Sentinel: accepted, and the store URL in the Secret', async (t) => {
    const ns = 'chart-redis'
    await kube.createNamespace(ns)
    const file = join(dir, 'redis.yaml')
    writeFileSync(file, (await kube.helm(['template', 'r', chart, '--namespace', ns, ...ADMIN, '--set', 'router.replicas=2', '--set', 'redis.enabled=true', '--set', 'redis.password=s3cr:t@x', '--set', 'redis.persistence.enabled=true'])).stdout)
    const { stdout } = await kube.kubectl(['apply', '--dry-run=server', '-n', ns, '-f', file, '-o', 'json'])
    const items = (JSON.parse(stdout) as { items?: (K8sObject & { stringData?: Record<string, string>; spec?: Record<string, unknown> })[] }).items ?? []
    t.same(
      items.filter((i) => i.metadata.name === 'r-handoff-redis').map((i) => i.kind).sort(),
      ['NetworkPolicy', 'Service', 'StatefulSet'],
      'a StatefulSet, its Service and a NetworkPolicy, accepted by the API server',
    )
    const secret = items.find((i) => i.kind === 'Secret')
    const data = Object.fromEntries(Object.entries((secret as { data?: Record<string, string> })?.data ?? {}).map(([k, v]) => [k, Buffer.from(v, 'base64').toString('utf8')]))
    t.equal(data['store-url'], 'redis://:s3cr%3At%40x@r-handoff-redis:6379', 'the routers’ store URL names it, the password URL-encoded')
    t.equal(data['redis-password'], 's3cr:t@x', 'Redis takes the password from the Secret')
    t.match(JSON.stringify(items.find((i) => i.kind === 'StatefulSet')), /"volumeClaimTemplates"/, 'persistence: a claim')
    const policy = items.find((i) => i.kind === 'NetworkPolicy' && i.metadata.name === 'r-handoff-redis')
    t.match(JSON.stringify(policy), /"app.kubernetes.io\/component":"router"/, 'only the routers reach it')

    const sentinel = await kube.helm(['template', 'r', chart, '--show-only', 'templates/secret.yaml', ...ADMIN, '--set', 'router.replicas=2', '--set', 'store.sentinel.hosts={s-0.sentinel:26379,s-1.sentinel:26379}', '--set', 'store.sentinel.password=pw', '--set', 'store.sentinel.sentinelPassword=spw'])
    const url = /store-url: "(.*)"/.exec(sentinel.stdout)?.[1] ?? ''
    t.equal(url, 'redis+sentinel://:pw@s-0.sentinel:26379,s-1.sentinel:26379/mymaster?sentinelPassword=spw', 'Sentinel: a redis+sentinel:// URL')
    const cfg = join(dir, 'sentinel.json')
    writeFileSync(cfg, JSON.stringify({ port: 0 }))
    t.match(loadConfig({ file: cfg, env: { HANDOFF_STORE: url } }), { store: { url } }, 'which the router’s config loader takes')
  })

  t.test('a ServiceMonitor on request, scraping the routers’ /metrics', async (t) => {
    t.notMatch((await kube.helm(['template', 'r', chart, ...ADMIN])).stdout, /kind: ServiceMonitor/, 'none by default (its CRD may be missing)')
    const { stdout } = await kube.helm(['template', 'r', chart, ...ADMIN, '--set', 'metrics.serviceMonitor.enabled=true', '--set', 'metrics.serviceMonitor.labels.release=prom'])
    const sm = stdout.split(/^---$/m).find((d) => /kind: ServiceMonitor/.test(d)) ?? ''
    t.match(sm, /release: prom/, 'with the labels Prometheus selects by')
    t.match(sm, /endpoints:\n\s+- port: http\n\s+path: \/metrics/, 'the data port’s /metrics')
    t.match(sm, /matchLabels:\n\s+app\.kubernetes\.io\/name: handoff\n\s+app\.kubernetes\.io\/instance: r\n\s+app\.kubernetes\.io\/component: router/, 'through the routers’ Service')
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
    t.match(await fails([...ADMIN, '--set', 'router.replicas=2']), /router\.replicas > 1 needs a Redis \(store\.redisUrl, store\.sentinel or redis\.enabled\)/)
    t.match(await fails([...ADMIN, '--set', 'redis.enabled=true', '--set', 'store.redisUrl=redis://redis:6379']), /redis\.enabled and store\.redisUrl are two stores/)
    t.match(await fails([...ADMIN, '--set', 'router.terminationGracePeriodSeconds=10']), /shutdownGraceMs plus router.preStopSleepSeconds must stay below/)
    t.equal(await fails([...ADMIN, '--set', 'router.replicas=2', '--set', 'store.redisUrl=redis://redis:6379']), '', 'two replicas on Redis render')
  })
})
