import { execFile, spawn, spawnSync } from 'node:child_process'
import { existsSync, mkdtempSync, rmSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { setTimeout as sleep } from 'node:timers/promises'
import { promisify } from 'node:util'
import t from 'tap'
import { request } from 'undici'
import { packageRoot } from '../../common/paths.js'
import { kubeBinDir, needKube } from '../helpers/kube.js'

// Issue 22: the chart on a real single-node cluster (scripts/k8s-node.sh: etcd, the control
// plane, a kubelet with containerd, kube-proxy), which a dry-run against an API server cannot
// stand in for: a kubelet injects service links, runs probes and preStop hooks, and evicts
// through PodDisruptionBudgets. The handoff image is built from dist/ and node_modules without
// a registry (scripts/node-image.sh); the engine pods run the simulator (engines.simulator).
// `helm install handoff` (the documented release name), load through the router's Service,
// the prefillers scaled down under it: the removed pod's preStop drain holds it until the
// router has no unread lease of it, and no request fails.

// The node takes host settings for its life (iptables, sysctls): .taprc runs this file alone.
t.setTimeout(600_000)

const root = packageRoot
const run = promisify(execFile)
const ADMIN = 'admin-token-for-tests'
const RELEASE = 'handoff'
const MODEL = 'handoff/sim-1'

function needNode(tt: { fail(message: string): void }): string | false {
  const kube = needKube(tt, { helm: true })
  if (kube) return kube
  const absent: string[] = []
  if (process.getuid?.() !== 0) absent.push('root')
  for (const bin of ['kubelet', 'kube-controller-manager', 'kube-scheduler', 'kube-proxy']) if (!existsSync(join(kubeBinDir, bin))) absent.push(join(kubeBinDir, bin))
  for (const cmd of ['containerd', 'runc', 'ctr', 'gcc', 'iptables']) if (spawnSync('sh', ['-c', `command -v ${cmd}`], { stdio: 'ignore' }).status !== 0) absent.push(cmd)
  if (!existsSync('/usr/lib/cni/ptp')) absent.push('/usr/lib/cni/ptp')
  if (absent.length === 0) return false
  const why = `${absent.join(', ')} missing: apt-get install containerd runc containernetworking-plugins; scripts/k8s-tools.sh --node`
  if (process.env.CI) tt.fail(why)
  return why
}

interface Pod {
  metadata: { name: string; labels?: Record<string, string>; deletionTimestamp?: string }
  status?: { podIP?: string; conditions?: { type: string; status: string }[] }
}

t.test('helm install handoff on a real node: routers ready, a prefiller scaled down under load drains with no failed request, PDBs honoured', { skip: needNode(t) }, async (t) => {
  const dir = mkdtempSync(join(tmpdir(), 'handoff-node-'))
  t.teardown(() => rmSync(dir, { recursive: true, force: true }))
  const script = join(root, 'scripts/k8s-node.sh')
  // Whatever happens, the node goes and the machine's settings come back.
  t.teardown(async () => {
    const down = await run(script, ['down'], { timeout: 120_000 }).catch((e: { stderr?: string }) => ({ stderr: e.stderr ?? String(e) }))
    t.comment(down.stderr.trim())
  })
  const started = performance.now()
  const up = await run(script, ['up'], { timeout: 300_000 })
  const kubeconfig = up.stdout.trim().split('\n').at(-1) ?? ''
  t.comment(`${up.stderr.trim()} (${((performance.now() - started) / 1000).toFixed(1)} s)`)
  const kubectl = async (...args: string[]): Promise<string> => (await run(join(kubeBinDir, 'kubectl'), ['--kubeconfig', kubeconfig, ...args], { timeout: 60_000 })).stdout
  const helm = async (...args: string[]): Promise<string> => {
    const home = join(dir, 'helm')
    const env = { ...process.env, HOME: home, HELM_CACHE_HOME: join(home, 'cache'), HELM_CONFIG_HOME: join(home, 'config'), HELM_DATA_HOME: join(home, 'data') }
    return (await run(join(kubeBinDir, 'helm'), ['--kubeconfig', kubeconfig, ...args], { timeout: 120_000, env })).stdout
  }
  const pods = async (selector: string): Promise<Pod[]> => (JSON.parse(await kubectl('get', 'pods', '-l', selector, '-o', 'json')) as { items: Pod[] }).items
  const ready = (p: Pod): boolean => !p.metadata.deletionTimestamp && Boolean(p.status?.conditions?.some((c) => c.type === 'Ready' && c.status === 'True'))
  const waitUntil = async (what: string, ms: number, fn: () => Promise<boolean>): Promise<boolean> => {
    for (const deadline = performance.now() + ms; performance.now() < deadline; await sleep(250)) if (await fn().catch(() => false)) return true
    t.comment(`${what}: not within ${ms} ms`)
    return false
  }

  // The image, as the Dockerfile lays it out, imported into the node's containerd.
  const image = join(dir, 'handoff.tar')
  await run(join(root, 'scripts/node-image.sh'), [image], { timeout: 300_000 })
  await run(script, ['import', image], { timeout: 300_000 })

  // The routers first: the engines' preStop hook asks the `-admin` Service by name, and this
  // node has no cluster DNS, so the engine pods map that name to its ClusterIP (hostAliases).
  const values = join(dir, 'values.yaml')
  writeFileSync(
    values,
    JSON.stringify({
      image: { repository: 'handoff', tag: 'test', pullPolicy: 'Never' },
      secrets: { adminToken: ADMIN, agentToken: 'agent-token-for-tests', drainToken: 'drain-token-for-tests' },
      router: { resources: { requests: { cpu: '50m', memory: '64Mi' } }, config: { health: { intervalMs: 1000 } } },
      engines: {
        model: MODEL,
        // D answers 2 s after the prefill: each lease stays unread that long.
        simulator: { enabled: true, args: ['--decode-queue-ms', '2000'] },
        shmSize: '64Mi',
        probes: { startup: { periodSeconds: 1, failureThreshold: 60, timeoutSeconds: 2 }, readiness: { periodSeconds: 1, failureThreshold: 2, timeoutSeconds: 2 } },
        drain: { progressSeconds: 1 },
        prefill: { enabled: false, replicas: 2, terminationGracePeriodSeconds: 60, resources: { requests: { cpu: '50m', memory: '64Mi' }, limits: null } },
        decode: { enabled: false, replicas: 2, terminationGracePeriodSeconds: 60, resources: { requests: { cpu: '50m', memory: '64Mi' }, limits: null } },
      },
    }),
  )
  await helm('install', RELEASE, join(root, 'deploy/helm/handoff'), '-f', values)
  const svc = async (name: string): Promise<string> => (await kubectl('get', 'service', name, '-o', 'jsonpath={.spec.clusterIP}')).trim()
  const [routerIp, adminIp] = [await svc(RELEASE), await svc(`${RELEASE}-admin`)]
  const hostAliases = [{ ip: adminIp, hostnames: [`${RELEASE}-admin.default.svc`] }]
  await helm(
    'upgrade', RELEASE, join(root, 'deploy/helm/handoff'), '--reuse-values',
    '--set', 'engines.prefill.enabled=true', '--set', 'engines.decode.enabled=true',
    '--set-json', `engines.prefill.podSpec=${JSON.stringify({ hostAliases })}`, '--set-json', `engines.decode.podSpec=${JSON.stringify({ hostAliases })}`,
  )
  const base = `http://${routerIp}:8000`
  const admin = `http://${adminIp}:8001`
  const auth = { authorization: `Bearer ${ADMIN}` }
  const topology = async (): Promise<{ id: string; role: string; state: string }[]> =>
    ((await (await request(`${admin}/topology`, { headers: auth, headersTimeout: 5000 })).body.json()) as { instances: { id: string; role: string; state: string }[] }).instances

  const t0 = performance.now()
  t.ok(await waitUntil('2 prefillers and 2 decoders Ready', 120_000, async () => (await pods('handoff.dev/release=handoff')).filter(ready).length === 4), 'the engine pods are Ready')
  t.ok(await waitUntil('the router Ready', 60_000, async () => (await pods('app.kubernetes.io/component=router')).some(ready)), 'the router pod is Ready')
  t.ok(await waitUntil('4 instances ready', 30_000, async () => (await topology()).filter((i) => i.state === 'ready').length === 4), 'the router found the four engine pods')
  t.comment(`engines and router Ready ${((performance.now() - t0) / 1000).toFixed(1)} s after the install`)

  // Defect 1 on a real kubelet: with service links on, the kubelet injects HANDOFF_PORT=tcp://…
  // (the client Service is `handoff`); the router ignores it and starts.
  await kubectl('patch', 'deployment', RELEASE, '--type', 'json', '-p', '[{"op":"replace","path":"/spec/template/spec/enableServiceLinks","value":true}]')
  await kubectl('rollout', 'status', `deployment/${RELEASE}`, '--timeout', '120s')
  // The `-admin` Service keeps not-Ready routers (publishNotReadyAddresses), a stopping one too
  // until its pod is gone: wait for that, so every call below reaches the new router.
  t.ok(await waitUntil('the old router pod gone', 60_000, async () => (await pods('app.kubernetes.io/component=router')).length === 1), 'the old router pod is gone')
  const [routerPod] = (await pods('app.kubernetes.io/component=router')).filter(ready)
  const injected = (await kubectl('exec', routerPod?.metadata.name ?? 'none', '--', 'node', '-e', 'process.stdout.write(process.env.HANDOFF_PORT ?? "")')).trim()
  t.equal(injected, `tcp://${routerIp}:8000`, 'the kubelet injected the service link HANDOFF_PORT')
  t.ok(routerPod && ready(routerPod), 'and the router with it is Ready')
  t.match(await kubectl('logs', routerPod?.metadata.name ?? 'none'), /HANDOFF_PORT.*service link/, 'it logged that it ignored it')
  t.ok(await waitUntil('4 instances ready again', 30_000, async () => (await topology()).filter((i) => i.state === 'ready').length === 4), 'the new router found the engines')

  // Load through the router's Service, from outside the cluster.
  const failures: string[] = []
  let sent = 0
  let stop = false
  const client = async (n: number): Promise<void> => {
    for (let i = 0; !stop; i++) {
      sent++
      try {
        const res = await request(`${base}/v1/completions`, {
          method: 'POST',
          headers: { 'content-type': 'application/json' },
          body: JSON.stringify({ model: MODEL, prompt: `client ${n} request ${i}`, max_tokens: 4 }),
          headersTimeout: 30_000,
          bodyTimeout: 30_000,
        })
        const text = await res.body.text()
        if (res.statusCode !== 200) failures.push(`${res.statusCode} ${text.slice(0, 160)}`)
      } catch (err) {
        failures.push(String(err))
      }
    }
  }
  const load = Promise.all(Array.from({ length: 8 }, (_, n) => client(n)))
  try {
    // Whichever prefiller the ReplicaSet removes, decoders still have to read its blocks.
    const prefillers = (await topology()).filter((i) => i.role === 'prefill').map((i) => i.id)
    t.ok(
      await waitUntil('both prefillers holding unread leases', 20_000, async () => {
        const { byPrefill } = (await (await request(`${admin}/leases`, { headers: auth })).body.json()) as { byPrefill: Record<string, number> }
        return prefillers.every((id) => (byPrefill[id] ?? 0) > 0)
      }),
      'under load both prefillers hold leases decoders have not read yet',
    )
    // Scale down; the ReplicaSet picks the pod, the kubelet runs its preStop drain.
    await kubectl('scale', 'deployment', `${RELEASE}-prefill`, '--replicas', '1')
    let victim: Pod | undefined
    await waitUntil('a prefiller terminating', 20_000, async () => {
      victim = (await pods('handoff.dev/release=handoff,handoff.dev/role=prefill')).find((p) => p.metadata.deletionTimestamp)
      return Boolean(victim)
    })
    const name = victim?.metadata.name ?? 'none'
    const id = `k8s:default:${name}`
    t.ok(victim, `the ReplicaSet chose ${name}`)
    // While the pod is terminating: what the router holds of it, and the hook's lines (it
    // writes them to the container's stderr too: engines.drain.logToContainer).
    const follow = spawn(join(kubeBinDir, 'kubectl'), ['--kubeconfig', kubeconfig, 'logs', '-f', name], { stdio: ['ignore', 'pipe', 'ignore'] })
    let logs = ''
    follow.stdout.on('data', (b: Buffer) => (logs += b.toString('utf8')))
    let maxUnread = 0
    let unreadGoneAt = Number.NaN
    const t1 = performance.now()
    for (const deadline = t1 + 60_000; performance.now() < deadline; await sleep(100)) {
      const res = await request(`${admin}/leases?instance=${encodeURIComponent(id)}`, { headers: auth })
      const text = await res.body.text()
      if (res.statusCode !== 200) t.comment(`GET /leases?instance=${id}: ${res.statusCode} ${text.slice(0, 200)}`)
      const unread = res.statusCode === 200 ? ((JSON.parse(text) as { byPrefill: Record<string, number> }).byPrefill[id] ?? 0) : 0
      maxUnread = Math.max(maxUnread, unread)
      if (unread === 0 && Number.isNaN(unreadGoneAt)) unreadGoneAt = performance.now() - t1
      if (!(await kubectl('get', 'pods', '--field-selector', `metadata.name=${name}`, '-o', 'name')).trim()) break
    }
    follow.kill()
    const hookLines = logs.split('\n').filter((l) => l.startsWith('handoff-prestop:')).join('\n')
    const goneAt = performance.now() - t1
    t.comment(`${name}: at most ${maxUnread} unread lease(s) while terminating; none from ${unreadGoneAt.toFixed(0)} ms; the pod gone after ${goneAt.toFixed(0)} ms\n${hookLines}`)
    t.match(hookLines, new RegExp(`draining ${id}`), 'the preStop hook ran and asked the router to drain the pod')
    t.match(hookLines, new RegExp(`${id} (drained after|removed after|gone from)`), 'and returned once the router held nothing of it')
    t.ok(maxUnread > 0, `the router held unread leases of the pod when its termination began (${maxUnread})`)
    t.ok(unreadGoneAt <= goneAt, 'the pod outlived its last unread lease')
    t.notOk((await topology()).some((i) => i.id === id), 'the drained prefiller left the topology')
    await sleep(2000) // traffic goes on over the prefiller left
  } finally {
    stop = true
    await load
  }
  t.comment(`${sent} requests through the router's Service, ${failures.length} failed`)
  t.same(failures, [], `no request failed (${sent} sent)`)

  // The engine PodDisruptionBudget (maxUnavailable 1) over two decoders: one eviction at a
  // time; the second is refused while the first drains.
  const decoders = (await pods('handoff.dev/release=handoff,handoff.dev/role=decode')).filter(ready)
  t.equal(decoders.length, 2, 'two decoders')
  const body = (pod: string): string => JSON.stringify({ apiVersion: 'policy/v1', kind: 'Eviction', metadata: { name: pod, namespace: 'default' } })
  const evictPod = async (pod: string): Promise<number> => {
    const file = join(dir, `evict-${pod}.json`)
    writeFileSync(file, body(pod))
    return run(join(kubeBinDir, 'kubectl'), ['--kubeconfig', kubeconfig, 'create', '--raw', `/api/v1/namespaces/default/pods/${pod}/eviction`, '-f', file], { timeout: 30_000 }).then(
      () => 201,
      (e: { stderr?: string }) => (/TooManyRequests|disruption budget/i.test(e.stderr ?? '') ? 429 : Number.NaN),
    )
  }
  t.ok(await waitUntil('the decoders’ PDB allows one disruption', 30_000, async () => (await kubectl('get', 'pdb', `${RELEASE}-decode`, '-o', 'jsonpath={.status.disruptionsAllowed}')).trim() === '1'), 'the decoders’ PDB allows one disruption')
  const first = await evictPod(decoders[0]?.metadata.name ?? 'none')
  const second = await evictPod(decoders[1]?.metadata.name ?? 'none')
  t.equal(first, 201, 'the first decoder is evicted (its preStop drain runs)')
  t.equal(second, 429, 'the second is refused by the PodDisruptionBudget while the first is away')
})
