import { execFile } from 'node:child_process'
import { mkdirSync, mkdtempSync, readFileSync, readdirSync, rmSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { dirname, join, resolve } from 'node:path'
import { fileURLToPath } from 'node:url'
import { promisify } from 'node:util'
import t from 'tap'
import { startRouter } from '../helpers/cluster.js'
import { needKube, startKube, type LocalKube } from '../helpers/kube.js'

// Issue 11, the engine side of the chart: engine Deployments (vLLM, discovery labels, the
// blocking preStop drain, the transfer-agent sidecar) and the standalone examples in
// deploy/examples/ are accepted by a real API server; pods made from their templates are the
// ones the router's discovery selectors pick; the rendered preStop command, run with the
// rendered script and token, drains at a real router; bad engine values fail at render time.

const root = resolve(dirname(fileURLToPath(import.meta.url)), '../..')
const chart = join(root, 'deploy/helm/handoff')
const examples = join(root, 'deploy/examples')
const run = promisify(execFile)
const ADMIN_TOKEN = 'admin-token-for-tests'
const DRAIN_TOKEN = 'drain-token-for-tests'
const ADMIN = ['--set', `secrets.adminToken=${ADMIN_TOKEN}`, '--set', 'secrets.agentToken=agent-token-for-tests', '--set', `secrets.drainToken=${DRAIN_TOKEN}`]
const ENGINES = [...ADMIN, '--set', 'engines.prefill.enabled=true', '--set', 'engines.decode.enabled=true']
const AGENT = ['--set', 'engines.agent.enabled=true', '--set', 'secrets.agentToken=agent-token-for-tests', '--set', 'secrets.peerSecret=peer-secret-for-tests']

interface Container {
  name: string
  image: string
  command?: string[]
  args?: string[]
  restartPolicy?: string
  env?: { name: string; value?: string; valueFrom?: { fieldRef?: { fieldPath: string }; secretKeyRef?: { name: string; key: string } } }[]
  readinessProbe?: { httpGet?: { path: string; port: string | number } }
  startupProbe?: { httpGet?: { path: string; port: string | number }; periodSeconds?: number; failureThreshold?: number }
  livenessProbe?: { httpGet?: { path: string; port: string | number }; periodSeconds?: number; failureThreshold?: number }
  resources?: { requests?: Record<string, string>; limits?: Record<string, string | number> }
  securityContext?: { capabilities?: { add?: string[] } }
  ports?: { name: string; containerPort: number }[]
  lifecycle?: { preStop?: { exec?: { command: string[] } } }
  volumeMounts?: { name: string; mountPath: string }[]
}
interface PodTemplate {
  metadata: { labels: Record<string, string>; annotations?: Record<string, string> }
  spec: {
    terminationGracePeriodSeconds: number
    containers: Container[]
    initContainers?: Container[]
    volumes?: {
      name: string
      projected?: { sources: { configMap?: { name: string }; secret?: { name: string; items?: { key: string; path: string }[] } }[] }
      emptyDir?: { medium?: string; sizeLimit?: string }
      persistentVolumeClaim?: { claimName: string }
      hostPath?: { path: string }
    }[]
    priorityClassName?: string
  }
}
interface PolicyPeer {
  podSelector?: { matchLabels?: Record<string, string> }
  namespaceSelector?: { matchLabels?: Record<string, string> }
}
interface K8sObject {
  kind: string
  metadata: { name: string }
  data?: Record<string, string>
  spec?: {
    template: PodTemplate
    strategy?: { type: string; rollingUpdate?: { maxSurge?: number | string; maxUnavailable?: number | string } }
    maxUnavailable?: number
    selector?: { matchLabels?: Record<string, string> }
    scaleTargetRef?: { kind: string; name: string }
    podSelector?: { matchLabels?: Record<string, string> }
    ingress?: { ports?: { port: string | number }[]; from?: PolicyPeer[] }[]
  }
}

/** Whether a pod with `labels` in namespace `ns` is one of `peers`. */
function admits(peers: PolicyPeer[] | undefined, labels: Record<string, string>, ns: string): boolean {
  return (peers ?? []).some(
    (p) =>
      Object.entries(p.podSelector?.matchLabels ?? {}).every(([k, v]) => labels[k] === v) &&
      Object.entries(p.namespaceSelector?.matchLabels ?? {}).every(([k, v]) => k === 'kubernetes.io/metadata.name' && v === ns),
  )
}

async function applyDryRun(kube: LocalKube, ns: string, file: string): Promise<K8sObject[]> {
  const { stdout } = await kube.kubectl(['apply', '--dry-run=server', '-n', ns, '-f', file, '-o', 'json'])
  const out = JSON.parse(stdout) as { items?: K8sObject[] } & K8sObject
  return out.items ?? [out]
}

/** A pod made from `template`, as the ReplicaSet controller would (there is none here). */
async function podFrom(kube: LocalKube, ns: string, name: string, template: PodTemplate): Promise<void> {
  await kube.api('POST', `/api/v1/namespaces/${ns}/pods`, {
    body: { apiVersion: 'v1', kind: 'Pod', metadata: { name, labels: template.metadata.labels }, spec: { ...template.spec, nodeName: 'test-node' } },
  })
}

/** Names of the pods in `ns` the API server selects with `selector`. */
async function selected(kube: LocalKube, ns: string, selector: string): Promise<string[]> {
  const res = await kube.api<{ items: { metadata: { name: string } }[] }>('GET', `/api/v1/namespaces/${ns}/pods?labelSelector=${encodeURIComponent(selector)}`)
  return res.body.items.map((p) => p.metadata.name).sort()
}

const preStop = (c: Container | undefined): string[] => c?.lifecycle?.preStop?.exec?.command ?? []
const flag = (cmd: string[], name: string): string | undefined => {
  const i = cmd.indexOf(name)
  return i >= 0 ? cmd[i + 1] : undefined
}

t.test('engine pods in the Helm chart and the examples, against a real API server', { skip: needKube(t, { helm: true }) }, async (t) => {
  const kube = await startKube(t)
  const dir = mkdtempSync(join(tmpdir(), 'handoff-engines-'))
  t.teardown(() => rmSync(dir, { recursive: true, force: true }))
  const template = async (release: string, ns: string, args: string[]): Promise<string> => {
    const file = join(dir, `${release}-${ns}.yaml`)
    writeFileSync(file, (await kube.helm(['template', release, chart, '--namespace', ns, ...args])).stdout)
    return file
  }

  t.test('helm lint --strict is clean with engines and agents on', async (t) => {
    const { stdout } = await kube.helm(['lint', chart, '--strict', ...ENGINES, ...AGENT])
    t.match(stdout, /1 chart\(s\) linted, 0 chart\(s\) failed/)
    t.notMatch(stdout, /\[(WARNING|ERROR)\]/)
  })

  t.test('engine Deployments: accepted, selected by discovery, wired for the drain', async (t) => {
    const ns = 'engines-llm'
    await kube.createNamespace(ns)
    const items = await applyDryRun(kube, ns, await template('r', ns, [...ENGINES, ...AGENT]))
    t.same(
      items.map((i) => `${i.kind}/${i.metadata.name}`).sort(),
      [
        'ConfigMap/r-handoff',
        'ConfigMap/r-handoff-prestop',
        'Deployment/r-handoff',
        'Deployment/r-handoff-decode',
        'Deployment/r-handoff-prefill',
        'NetworkPolicy/r-handoff',
        'NetworkPolicy/r-handoff-decode-ingress',
        'NetworkPolicy/r-handoff-prefill-ingress',
        'PodDisruptionBudget/r-handoff-decode',
        'PodDisruptionBudget/r-handoff-prefill',
        'Role/r-handoff-discovery',
        'RoleBinding/r-handoff-discovery',
        'Secret/r-handoff',
        'Service/r-handoff',
        'Service/r-handoff-admin',
        'ServiceAccount/r-handoff',
      ],
      'every object accepted by the API server',
    )
    const script = readFileSync(join(chart, 'files/prestop-drain.py'), 'utf8')
    const cm = items.find((i) => i.metadata.name === 'r-handoff-prestop')
    t.equal(cm?.data?.['prestop-drain.py']?.trimEnd(), script.trimEnd(), 'the ConfigMap holds files/prestop-drain.py')
    const discovery = (JSON.parse(items.find((i) => i.kind === 'ConfigMap' && i.metadata.name === 'r-handoff')?.data?.['router.json'] ?? '{}') as { discovery: Record<string, { selector: string }> })
      .discovery

    for (const role of ['prefill', 'decode'] as const) {
      const tpl = items.find((i) => i.kind === 'Deployment' && i.metadata.name === `r-handoff-${role}`)?.spec?.template
      t.ok(tpl, `${role}: a Deployment`)
      if (!tpl) continue
      const vllm = tpl.spec.containers.find((c) => c.name === 'vllm')
      t.match(vllm, { command: ['vllm', 'serve'], readinessProbe: { httpGet: { path: '/health', port: 'http' } } }, `${role}: vLLM, ready on /health`)
      t.equal(
        flag(vllm?.args ?? [], '--kv-transfer-config'),
        '{"kv_connector":"NixlConnector","kv_connector_extra_config":{"kv_lease_duration":30},"kv_role":"kv_both"}',
        `${role}: the NixlConnector, its kv_lease_duration from engines.leaseSeconds`,
      )
      // Issue 22: engine pods that fit production.
      const dep = items.find((i) => i.kind === 'Deployment' && i.metadata.name === `r-handoff-${role}`)
      t.match(dep?.spec?.strategy, { type: 'RollingUpdate', rollingUpdate: { maxSurge: 0, maxUnavailable: 1 } }, `${role}: no surge (a GPU pod cannot start beside the one it replaces)`)
      t.match(vllm?.startupProbe, { httpGet: { path: '/health', port: 'http' }, periodSeconds: 10, failureThreshold: 180 }, `${role}: a startup probe allowing 30 min to load`)
      t.match(vllm?.livenessProbe, { httpGet: { path: '/health', port: 'http' }, periodSeconds: 15, failureThreshold: 8 }, `${role}: a lenient liveness probe`)
      t.match(vllm?.resources, { requests: { cpu: '4', memory: '32Gi' } }, `${role}: CPU and memory requests (not BestEffort)`)
      t.match(tpl.spec.volumes?.find((v) => v.name === 'dshm'), { emptyDir: { medium: 'Memory', sizeLimit: '16Gi' } }, `${role}: /dev/shm in memory`)
      t.ok(vllm?.volumeMounts?.some((m) => m.name === 'dshm' && m.mountPath === '/dev/shm'), `${role}: mounted at /dev/shm`)
      t.equal(tpl.metadata.annotations?.['handoff.dev/side-channel-port'], '5600', `${role}: the side-channel port published for discovery`)
      t.equal(vllm?.env?.find((e) => e.name === 'VLLM_NIXL_SIDE_CHANNEL_PORT')?.value, '5600', `${role}: the same port vLLM listens on`)
      // Issue 39: the engines publish their KV cache events where the annotations say.
      t.equal(
        flag(vllm?.args ?? [], '--kv-events-config'),
        '{"enable_kv_cache_events":true,"endpoint":"tcp://*:5557","publisher":"zmq","replay_endpoint":"tcp://*:5558"}',
        `${role}: vLLM publishes its KV events`,
      )
      t.match(tpl.metadata.annotations, { 'handoff.dev/kv-events-port': '5557', 'handoff.dev/kv-events-replay-port': '5558' }, `${role}: at the ports its annotations publish for discovery`)
      const pdb = items.find((i) => i.kind === 'PodDisruptionBudget' && i.metadata.name === `r-handoff-${role}`)
      t.equal(pdb?.spec?.maxUnavailable, 1, `${role}: a PodDisruptionBudget, one at a time`)
      t.ok(Object.entries(pdb?.spec?.selector?.matchLabels ?? { none: 'x' }).every(([k, v]) => tpl.metadata.labels[k] === v), `${role}: over its pods`)
      const cmd = preStop(vllm)
      t.same(cmd.slice(0, 2), ['python3', '/etc/handoff-drain/prestop-drain.py'], `${role}: the preStop runs the drain script`)
      t.equal(flag(cmd, '--router-url'), `http://r-handoff-admin.${ns}.svc:8001`, `${role}: through the -admin Service, on the operations port`)
      t.equal(flag(cmd, '--token-file'), '/etc/handoff-drain/drain-token', `${role}: with the drain token, not the admin token`)
      t.equal(flag(cmd, '--deadline-seconds'), String(tpl.spec.terminationGracePeriodSeconds - 10), `${role}: deadline = grace period - margin`)
      t.same(
        (vllm?.env ?? []).filter((e) => e.name.startsWith('POD_')).map((e) => [e.name, e.valueFrom?.fieldRef?.fieldPath]),
        [
          ['POD_NAME', 'metadata.name'],
          ['POD_NAMESPACE', 'metadata.namespace'],
        ],
        `${role}: the pod's name and namespace from the downward API`,
      )
      const sources = tpl.spec.volumes?.find((v) => v.name === 'handoff-drain')?.projected?.sources ?? []
      t.same(
        sources.map((s) => s.configMap?.name ?? s.secret?.name),
        ['r-handoff-prestop', 'r-handoff'],
        `${role}: the script and the drain token mounted`,
      )
      const agent = tpl.spec.initContainers?.find((c) => c.name === 'transfer-agent')
      t.match(agent, { restartPolicy: 'Always', command: ['node', 'dist/handoff.js', 'agent'] }, `${role}: the agent as a native sidecar`)
      t.equal(flag(agent?.command ?? [], '--router-url'), `http://r-handoff-admin.${ns}.svc:8002`, `${role}: the agent follows the router on the agent port`)
      t.same(
        sources.flatMap((s) => s.secret?.items?.map((i) => i.key) ?? []),
        ['drain-token'],
        `${role}: no admin token in the engine pod`,
      )
      t.match(agent?.env?.find((e) => e.name === 'HANDOFF_AGENT_TOKEN'), { valueFrom: { secretKeyRef: { name: 'r-handoff', key: 'agent-token' } } })
      // Agents prove a secret of their own to each other (issue 18 §2), not the agent token.
      t.match(agent?.env?.find((e) => e.name === 'HANDOFF_PEER_SECRET'), { valueFrom: { secretKeyRef: { name: 'r-handoff', key: 'peer-secret' } } })
      // NetworkPolicies (issue 18 §4): this engine pod reaches the routers' operations and agent
      // ports; other engine pods and the routers reach it; clients reach only the data port.
      const routerPolicy = items.find((i) => i.kind === 'NetworkPolicy' && i.metadata.name === 'r-handoff')?.spec
      const byPort = (port: string) => routerPolicy?.ingress?.find((r) => r.ports?.some((p) => p.port === port))
      t.ok(admits(byPort('admin')?.from, tpl.metadata.labels, ns) && admits(byPort('agent')?.from, tpl.metadata.labels, ns), `${role}: may reach the routers' admin and agent ports`)
      t.notOk(admits(byPort('admin')?.from, { app: 'some-client' }, ns), `${role}: a client pod may not reach the admin port`)
      t.equal(byPort('http')?.from, undefined, 'clients reach the data port from anywhere')
      const own = items.find((i) => i.kind === 'NetworkPolicy' && i.metadata.name === `r-handoff-${role}-ingress`)?.spec
      t.ok(Object.entries(own?.podSelector?.matchLabels ?? { none: 'x' }).every(([k, v]) => tpl.metadata.labels[k] === v), `${role}: its NetworkPolicy selects its pods`)
      const routerPod = items.find((i) => i.kind === 'Deployment' && i.metadata.name === 'r-handoff')?.spec?.template.metadata.labels ?? {}
      const other = items.find((i) => i.kind === 'Deployment' && i.metadata.name === `r-handoff-${role === 'prefill' ? 'decode' : 'prefill'}`)?.spec?.template.metadata.labels ?? {}
      t.ok(admits(own?.ingress?.[0]?.from, routerPod, ns) && admits(own?.ingress?.[0]?.from, other, ns), `${role}: the routers and the other engines reach it`)
      t.notOk(admits(own?.ingress?.[0]?.from, { app: 'some-client' }, ns), `${role}: nothing else does`)
      // The API server itself evaluates the router's selectors against a pod of this template.
      await podFrom(kube, ns, `${role}-pod`, tpl)
    }
    t.same(await selected(kube, ns, discovery.prefill?.selector ?? ''), ['prefill-pod'], "the prefill selector picks the prefill engine's pod only")
    t.same(await selected(kube, ns, discovery.decode?.selector ?? ''), ['decode-pod'], "the decode selector picks the decode engine's pod only")
  })

  t.test('the rendered preStop command, with the rendered script and token, drains at a real router', async (t) => {
    const ns = 'engines-run'
    await kube.createNamespace(ns)
    const items = await applyDryRun(kube, ns, await template('r', ns, ENGINES))
    const cmd = preStop(items.find((i) => i.kind === 'Deployment' && i.metadata.name === 'r-handoff-prefill')?.spec?.template.spec.containers[0])
    // The projected volume, as the kubelet would write it.
    const mount = join(dir, 'etc-handoff-drain')
    mkdirSync(mount, { recursive: true })
    writeFileSync(join(mount, 'prestop-drain.py'), items.find((i) => i.metadata.name === 'r-handoff-prestop')?.data?.['prestop-drain.py'] ?? '')
    writeFileSync(join(mount, 'drain-token'), DRAIN_TOKEN)
    const router = await startRouter(t, [{ id: `k8s:${ns}:prefill-abc`, role: 'prefill', url: 'http://127.0.0.1:9' }], { adminToken: ADMIN_TOKEN, drainTokens: [DRAIN_TOKEN], probe: false })
    const args = cmd.slice(1).map((a) => a.replace('/etc/handoff-drain', mount).replace(`http://r-handoff-admin.${ns}.svc:8001`, router.url))
    const logFile = join(dir, 'container-stderr')
    const i = args.indexOf('--log-file')
    if (i >= 0) args[i + 1] = logFile
    const res = await run(cmd[0] ?? 'python3', args, { env: { PATH: process.env.PATH ?? '', POD_NAMESPACE: ns, POD_NAME: 'prefill-abc' }, timeout: 30_000 })
    t.match(res.stderr, new RegExp(`k8s:${ns}:prefill-abc drained after`), res.stderr)
    t.match(readFileSync(logFile, 'utf8'), /drained after/, 'and the same lines in the --log-file (the container log)')
  })

  t.test('the examples in deploy/examples/: accepted, selected, wired to the chart', async (t) => {
    const ns = 'examples'
    await kube.createNamespace(ns)
    t.same(readdirSync(examples).filter((f) => f.endsWith('.yaml')).sort(), ['hpa-decode.yaml', 'vllm-decode.yaml', 'vllm-prefill.yaml'])
    const files = ['vllm-decode.yaml', 'vllm-prefill.yaml']
    // The chart as an operator who brings their own engines installs it: release `handoff`.
    const chartItems = await applyDryRun(kube, ns, await template('handoff', ns, ADMIN))
    const names = new Set(chartItems.map((i) => `${i.kind}/${i.metadata.name}`))
    const discovery = (JSON.parse(chartItems.find((i) => i.kind === 'ConfigMap' && i.metadata.name === 'handoff')?.data?.['router.json'] ?? '{}') as { discovery: Record<string, { selector: string }> })
      .discovery
    for (const file of files) {
      const [dep] = await applyDryRun(kube, ns, join(examples, file))
      t.equal(dep?.kind, 'Deployment', `${file}: accepted`)
      const tpl = dep?.spec?.template
      if (!tpl) continue
      const vllm = tpl.spec.containers[0]
      const cmd = preStop(vllm)
      t.same(cmd.slice(0, 2), ['python3', '/etc/handoff-drain/prestop-drain.py'], `${file}: the drain script`)
      t.ok(names.has(`Service/${new URL(flag(cmd, '--router-url') ?? 'http://x').hostname}`), `${file}: asks the chart's -admin Service`)
      t.equal(Number(flag(cmd, '--deadline-seconds')), tpl.spec.terminationGracePeriodSeconds - 10, `${file}: deadline = grace period - 10 s`)
      for (const s of tpl.spec.volumes?.find((v) => v.name === 'handoff-drain')?.projected?.sources ?? []) {
        if (s.configMap) t.ok(names.has(`ConfigMap/${s.configMap.name}`), `${file}: the chart makes ConfigMap ${s.configMap.name}`)
        if (s.secret) t.ok(names.has(`Secret/${s.secret.name}`), `${file}: the chart makes Secret ${s.secret.name}`)
      }
      await podFrom(kube, ns, file.replace('.yaml', ''), tpl)
    }
    t.same(await selected(kube, ns, discovery.prefill?.selector ?? ''), ['vllm-prefill'], 'the default prefill selector picks the example prefill pod')
    t.same(await selected(kube, ns, discovery.decode?.selector ?? ''), ['vllm-decode'], 'the default decode selector picks the example decode pod')
    const [hpa] = await applyDryRun(kube, ns, join(examples, 'hpa-decode.yaml'))
    t.match(hpa, { kind: 'HorizontalPodAutoscaler', spec: { scaleTargetRef: { kind: 'Deployment', name: 'vllm-decode' } } }, 'hpa-decode.yaml: accepted, scaling the example decoders')
    t.match(JSON.stringify(hpa), /handoff_router_admission_queue_depth/, 'on the routers’ queue')
  })

  // Issue 22 defect 5: the selectors were not scoped to the release, so two releases in one
  // namespace routed to each other's engines.
  t.test('two releases in one namespace: each router selects its own release’s engines only', async (t) => {
    const ns = 'engines-two'
    await kube.createNamespace(ns)
    const selectors: Record<string, Record<string, { selector: string }>> = {}
    for (const release of ['blue', 'green']) {
      const items = await applyDryRun(kube, ns, await template(release, ns, ENGINES))
      selectors[release] = (JSON.parse(items.find((i) => i.kind === 'ConfigMap' && i.metadata.name === `${release}-handoff`)?.data?.['router.json'] ?? '{}') as { discovery: Record<string, { selector: string }> }).discovery
      for (const role of ['prefill', 'decode']) {
        const tpl = items.find((i) => i.kind === 'Deployment' && i.metadata.name === `${release}-handoff-${role}`)?.spec?.template
        if (tpl) await podFrom(kube, ns, `${release}-${role}`, tpl)
      }
    }
    for (const release of ['blue', 'green']) {
      t.same(await selected(kube, ns, selectors[release]?.prefill?.selector ?? ''), [`${release}-prefill`], `${release}'s router selects its own prefiller only`)
      t.same(await selected(kube, ns, selectors[release]?.decode?.selector ?? ''), [`${release}-decode`], `${release}'s router selects its own decoder only`)
    }
    const unscoped = await kube.helm(['template', 'blue', chart, '--show-only', 'templates/configmap.yaml', ...ENGINES, '--set', 'discovery.scopeToRelease=false'])
    t.match(unscoped.stdout, /"selector": "app\.kubernetes\.io\/part-of=handoff,handoff\.dev\/role=prefill"/, 'scopeToRelease=false: the selector as given')
  })

  t.test('production engine values: RDMA, IPC_LOCK, a model cache, the HF token, pod spec extras; accepted', async (t) => {
    const ns = 'engines-prod'
    await kube.createNamespace(ns)
    const args = [
      ...ENGINES,
      ...['--set', 'engines.rdma.enabled=true', '--set', 'engines.modelCache.type=pvc', '--set', 'engines.modelCache.claimName=models'],
      ...['--set', 'engines.hfToken.secretName=hf', '--set', 'engines.prefill.podSpec.priorityClassName=system-node-critical', '--set', 'engines.sideChannelPort=5700'],
    ]
    const items = await applyDryRun(kube, ns, await template('r', ns, args))
    const tpl = items.find((i) => i.kind === 'Deployment' && i.metadata.name === 'r-handoff-prefill')?.spec?.template
    const vllm = tpl?.spec.containers.find((c) => c.name === 'vllm')
    t.match(vllm?.resources?.limits, { 'nvidia.com/gpu': '1', 'rdma/ib': '1' }, 'the RDMA resource beside the GPU')
    t.same(vllm?.securityContext?.capabilities?.add, ['IPC_LOCK'], 'IPC_LOCK for UCX')
    t.match(tpl?.spec.volumes?.find((v) => v.name === 'model-cache'), { persistentVolumeClaim: { claimName: 'models' } }, 'the model cache claim')
    t.match(vllm?.env?.find((e) => e.name === 'HF_HOME'), { value: '/models' }, 'HF_HOME on it')
    t.match(vllm?.env?.find((e) => e.name === 'HF_TOKEN'), { valueFrom: { secretKeyRef: { name: 'hf', key: 'token' } } }, 'HF_TOKEN from the Secret')
    t.equal(tpl?.spec.priorityClassName, 'system-node-critical', 'podSpec passed through')
    t.equal(tpl?.metadata.annotations?.['handoff.dev/side-channel-port'], '5700', 'the side-channel port as set')
    t.ok(vllm?.ports?.some((p) => p.name === 'nixl' && p.containerPort === 5700), 'on the container port too')
    const fails = async (extra: string[]): Promise<string> =>
      kube.helm(['template', 'r', chart, ...ENGINES, ...extra]).then(
        () => '',
        (e: { stderr?: string }) => e.stderr ?? '',
      )
    t.match(await fails(['--set', 'engines.prefill.podSpec.volumes=x']), /engines\.prefill\.podSpec\.volumes: the chart sets it/)
    t.match(await fails(['--set', 'engines.modelCache.type=nfs']), /engines\.modelCache\.type must be/)
    t.match(await fails(['--set', 'engines.modelCache.type=pvc']), /engines\.modelCache\.claimName is required/)
  })

  t.test('engines.simulator: the handoff image’s simulator in place of vLLM, with the same wiring; accepted', async (t) => {
    const ns = 'engines-sim'
    await kube.createNamespace(ns)
    const items = await applyDryRun(kube, ns, await template('r', ns, [...ENGINES, '--set', 'engines.simulator.enabled=true', '--set', 'engines.simulator.args={--decode-queue-ms,500}']))
    const tpl = items.find((i) => i.kind === 'Deployment' && i.metadata.name === 'r-handoff-decode')?.spec?.template
    const sim = tpl?.spec.containers[0]
    t.match(sim, { name: 'sim', image: 'handoff:0.1.0', command: ['node', 'dist/handoff.js', 'sim'] }, 'the simulator from the handoff image')
    t.same(sim?.args, ['--role', 'decode', '--host', '0.0.0.0', '--port', '8000', '--model', 'Qwen/Qwen3-0.6B', '--lease-seconds', '30', '--side-channel-host', '$(VLLM_NIXL_SIDE_CHANNEL_HOST)', '--side-channel-port', '5600', '--kv-events-config', '{"enable_kv_cache_events":true,"endpoint":"tcp://*:5557","publisher":"zmq","replay_endpoint":"tcp://*:5558"}', '--decode-queue-ms', '500'])
    t.same(preStop(sim).slice(0, 2), ['python3', '/etc/handoff-drain/prestop-drain.py'], 'the same preStop drain')
    t.match(sim?.readinessProbe, { httpGet: { path: '/health' } }, 'the same probes')
    const fails = await kube.helm(['template', 'r', chart, ...ENGINES, ...AGENT, '--set', 'engines.simulator.enabled=true']).then(
      () => '',
      (e: { stderr?: string }) => e.stderr ?? '',
    )
    t.match(fails, /engines\.simulator with engines\.agent\.enabled is not wired/)
    // engines.kvEvents off: no events, nothing for discovery to follow (the router routes on load).
    const off = await applyDryRun(kube, ns, await template('r', ns, [...ENGINES, '--set', 'engines.simulator.enabled=true', '--set', 'engines.kvEvents.enabled=false']))
    const offTpl = off.find((i) => i.kind === 'Deployment' && i.metadata.name === 'r-handoff-decode')?.spec?.template
    t.equal(flag(offTpl?.spec.containers[0]?.args ?? [], '--kv-events-config'), undefined, 'kvEvents off: no --kv-events-config')
    t.equal(offTpl?.metadata.annotations?.['handoff.dev/kv-events-port'], undefined, 'and no annotation')
  })

  t.test('bad engine values fail at render time with the reason', async (t) => {
    const fails = async (args: string[]): Promise<string> =>
      kube.helm(['template', 'r', chart, ...ENGINES, ...args]).then(
        () => '',
        (e: { stderr?: string }) => e.stderr ?? '',
      )
    t.match(await fails(['--set', 'engines.prefill.labels.handoff\\.dev/role=decode']), /engines\.prefill\.labels must include handoff\.dev\/role=prefill/)
    t.match(await fails(['--set', 'engines.decode.port=8100']), /engines\.decode\.port \(8100\) must equal discovery\.decode\.port \(8000\)/)
    t.match(await fails(['--set', 'engines.prefill.terminationGracePeriodSeconds=10']), /terminationGracePeriodSeconds must exceed engines\.drain\.marginSeconds/)
    t.match(await fails(['--set', 'engines.agent.enabled=true', '--set', 'secrets.agentToken=']), /secrets\.agentToken is required|engines\.agent\.enabled needs secrets\.agentToken/)
    t.match(await fails(['--set', 'discovery.prefill=null']), /engines\.prefill\.enabled needs discovery\.prefill/)
    t.equal(await fails(['--set', 'discovery.enabled=false', '--set', 'engines.decode.port=8100']), '', 'without discovery the ports are the operator’s business')
    t.equal(await fails([...AGENT, '--set', 'engines.drain.routerUrls={http://a:8000,http://b:8000}']), '', 'several router URLs render')
    t.match(await fails(['--set', 'engines.agent.enabled=true']), /engines\.agent\.enabled needs secrets\.peerSecret/)
    t.match(await fails([...AGENT, '--set', 'secrets.peerSecret=agent-token-for-tests']), /secrets\.peerSecret must differ from secrets\.agentToken/)
    // One lease length (issue 17 item 3): a router judging longer leases than the engines hold
    // would hand decoders freed blocks.
    t.match(await fails(['--set', 'router.config.leases.leaseSeconds=60']), /router\.config\.leases\.leaseSeconds \(60\) must equal engines\.leaseSeconds \(30\)/)
    t.match(
      await fails(['--set', 'engines.kvTransferConfig.kv_connector_extra_config.kv_lease_duration=10']),
      /kv_lease_duration \(10\) must equal engines\.leaseSeconds \(30\)/,
    )
    t.match(await fails(['--set', 'engines.prefill.args={--kv-transfer-config,x}']), /engines\.prefill\.args must not carry --kv-transfer-config/)
    t.equal(await fails(['--set', 'router.config.leases.leaseSeconds=30']), '', 'the same value renders')
    t.match(await fails(['--set', 'engines.connector=lmcache']), /engines\.connector must be nixl .* or handoff/)
    t.match(await fails([...AGENT, '--set', 'engines.connector=handoff']), /two followers of the same events/)
  })

  t.test('engines.connector=handoff: the engines load handoff’s connector, follow the routers, read the agent token from a file', async (t) => {
    const { stdout } = await kube.helm(['template', 'r', chart, ...ENGINES, '--set', 'engines.connector=handoff'])
    const docs = stdout.split(/^---$/m)
    const prefill = docs.find((d) => /kind: Deployment/.test(d) && /name: r-handoff-prefill\n/.test(d)) ?? ''
    const kv = JSON.parse(JSON.parse(/- --kv-transfer-config\n\s+- (".*")\n/.exec(prefill)?.[1] ?? '"{}"') as string) as Record<string, unknown>
    t.match(kv, {
      kv_connector: 'HandoffNixlConnector',
      kv_connector_module_path: 'handoff_vllm.connector',
      kv_connector_extra_config: { kv_lease_duration: 30, handoff_router_urls: ['http://r-handoff-admin.default.svc:8002'], handoff_token_file: '/etc/handoff-connector/agent-token' },
    })
    t.match(prefill, /name: HANDOFF_ENGINE_URL\n\s+value: "http:\/\/\$\(POD_IP\):8000"/, 'registered under the URL discovery dials')
    t.match(prefill, /- name: handoff-connector\n\s+secret:\n\s+secretName: r-handoff\n\s+items:\n\s+- key: agent-token/, 'the agent token as a file (rotations need no restart)')
    const nixl = (await kube.helm(['template', 'r', chart, ...ENGINES])).stdout
    t.notMatch(nixl, /HandoffNixlConnector|handoff-connector/, 'the default stays vLLM’s NixlConnector')
  })

  t.test('engines.leaseSeconds reaches the engines, the agents and the router', async (t) => {
    const { stdout } = await kube.helm(['template', 'r', chart, ...ENGINES, ...AGENT, '--set', 'engines.leaseSeconds=12', '--set', 'router.config.leases.marginMs=500'])
    const docs = stdout.split(/^---$/m)
    const routerJson = /router\.json: \|-?\n((?: {4}.*\n?)+)/.exec(docs.find((d) => /kind: ConfigMap/.test(d) && /router\.json/.test(d)) ?? '')?.[1] ?? '{}'
    const leases = (JSON.parse(routerJson.replace(/^ {4}/gm, '')) as { leases: Record<string, unknown> }).leases
    t.same(leases, { leaseSeconds: 12, marginMs: 500 }, "the router's ledger judges 12 s leases; its other lease settings stay")
    const prefill = docs.find((d) => /kind: Deployment/.test(d) && /name: r-handoff-prefill\n/.test(d)) ?? ''
    t.match(prefill, /kv_lease_duration\\":12/, "vLLM's kv_lease_duration")
    t.match(prefill, /- --lease-seconds\n\s+- "12"/, "the agent's --lease-seconds")
  })
})
