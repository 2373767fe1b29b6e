import { execFile } from 'node:child_process'
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { Writable } from 'node:stream'
import type { FastifyInstance } from 'fastify'
import pino from 'pino'
import t from 'tap'
import { buildApp } from '../../router/src/app.js'
import { loadConfig } from '../../router/src/config.js'
import { podInstanceId } from '../../router/src/discovery/kubernetes.js'
import type { InstanceView } from '../../router/src/topology/views.js'
import { startTcpProxy } from '../../bench/tcp-proxy.js'
import { cliEntry } from '../../common/paths.js'
import { freePort } from '../../common/ports.js'
import { get, post, simRequests, startSim, waitFor, type Teardown } from '../helpers/cluster.js'
import { needKube, startKube, type KubeUser, type LocalKube } from '../helpers/kube.js'

// Issue 11: discovery against a real kube-apiserver (etcd + API server, no kubelet: the test
// writes pod status itself). One API server for the file; a namespace and a router per test.

const ADMIN = 'admin-token-for-tests'
const PREFILL = { selector: 'app=engine,role=prefill', port: 0 }
const DECODE = { selector: 'app=engine,role=decode', port: 0 }

interface Router {
  app: FastifyInstance
  url: string
  logs: Record<string, unknown>[]
  view(id: string): InstanceView | undefined
}

let namespaces = 0
async function namespace(kube: LocalKube, grant = true): Promise<string> {
  const ns = `disc-${process.pid}-${++namespaces}`
  await kube.createNamespace(ns)
  if (grant) await kube.grantPodReader(ns, 'router')
  return ns
}

function writeConfig(t: Teardown, config: object): string {
  const dir = mkdtempSync(join(tmpdir(), 'handoff-disc-'))
  t.teardown(() => rmSync(dir, { recursive: true, force: true }))
  const file = join(dir, 'router.json')
  writeFileSync(file, JSON.stringify(config))
  return file
}

/** The router as `handoff router --config` would build it, its logs captured. */
async function startDiscoveringRouter(
  t: Teardown,
  kube: LocalKube,
  ns: string,
  roles: { prefill?: typeof PREFILL; decode?: typeof DECODE },
  opts: { user?: KubeUser; probe?: boolean; kubeconfig?: string; discovery?: Record<string, number> } = {},
): Promise<Router> {
  const file = writeConfig(t, {
    port: 0,
    logLevel: 'info',
    adminToken: ADMIN,
    health: { intervalMs: 200, timeoutMs: 500 },
    discovery: { kind: 'kubernetes', namespace: ns, kubeconfig: opts.kubeconfig ?? kube.kubeconfig(opts.user ?? 'router', ns), backoffMs: 100, maxBackoffMs: 1000, ...opts.discovery, ...roles },
  })
  const config = loadConfig({ file })
  const logs: Record<string, unknown>[] = []
  const sink = new Writable({
    write(chunk: Buffer, _enc, cb) {
      for (const line of chunk.toString('utf8').split('\n')) if (line) logs.push(JSON.parse(line) as Record<string, unknown>)
      cb()
    },
  })
  const app = await buildApp({ config, logger: pino({ level: 'info' }, sink), ...(opts.probe === false ? { probe: false } : {}) })
  t.teardown(() => app.close())
  const url = await app.listen({ host: '127.0.0.1', port: 0 })
  return { app, url, logs, view: (id) => app.topology.snapshot().instances.find((i) => i.id === id) }
}

async function readyPod(kube: LocalKube, ns: string, name: string, role: 'prefill' | 'decode', podIP: string, extra: Record<string, string> = {}): Promise<void> {
  await kube.createPod(ns, name, { labels: { app: 'engine', role, ...extra } })
  await kube.setPodStatus(ns, name, { ready: true, podIP })
}

async function peerGones(app: FastifyInstance): Promise<{ engineIds: string[]; reason: string }[]> {
  await app.events.settled()
  return (await app.events.store.since(0)).filter((e) => e.type === 'peer_gone') as unknown as { engineIds: string[]; reason: string }[]
}

t.test('kubernetes discovery against a real API server', { skip: needKube(t) }, async (t) => {
  const started = performance.now()
  const kube = await startKube(t)
  t.comment(`etcd + kube-apiserver ready in ${((performance.now() - started) / 1000).toFixed(1)} s (API server ${kube.startSeconds.toFixed(1)} s)`)

  t.test('a Ready pod is routed to within 2 s; not Ready: no new work at once, drained, gone', async (t) => {
    const ns = await namespace(kube)
    // Each pod has its own loopback address; the role's port is the same for every pod.
    const [pPort, dPort] = [await freePort(), await freePort()]
    const prefillSim = await startSim(t, ['--role', 'prefill', '--host', '127.0.0.2', '--port', String(pPort)])
    const decodeSim = await startSim(t, ['--role', 'decode', '--host', '127.0.0.3', '--port', String(dPort)])
    const router = await startDiscoveringRouter(t, kube, ns, { prefill: { ...PREFILL, port: pPort }, decode: { ...DECODE, port: dPort } })
    t.equal(router.app.topology.size, 0, 'no pods yet')

    const p = podInstanceId(ns, 'prefill-0')
    const d = podInstanceId(ns, 'decode-0')
    await kube.createPod(ns, 'prefill-0', { labels: { app: 'engine', role: 'prefill', transfer_group: 'a' } })
    await kube.createPod(ns, 'decode-0', { labels: { app: 'engine', role: 'decode', transfer_group: 'a' } })
    await new Promise((r) => setTimeout(r, 300))
    t.equal(router.app.topology.size, 0, 'a pod that is not Ready is no instance')

    const t0 = performance.now()
    await kube.setPodStatus(ns, 'prefill-0', { ready: true, podIP: '127.0.0.2' })
    await kube.setPodStatus(ns, 'decode-0', { ready: true, podIP: '127.0.0.3' })
    t.ok(await waitFor(() => router.view(p)?.healthy === true && router.view(d)?.healthy === true, 2000), 'both pods are healthy instances within 2 s')
    t.comment(`Ready → healthy instances in ${Math.round(performance.now() - t0)} ms`)
    const pv = router.view(p)
    t.match(pv, { role: 'prefill', source: 'kubernetes', url: `http://127.0.0.2:${pPort}`, labels: { app: 'engine', role: 'prefill', transfer_group: 'a' } })

    const topo = (await get(`${router.url}/topology`, { authorization: `Bearer ${ADMIN}` })).json<{ instances: { id: string; source: string; state: string }[] }>()
    t.same(
      topo.instances.map((i) => [i.id, i.source, i.state]).sort(),
      [
        [d, 'kubernetes', 'ready'],
        [p, 'kubernetes', 'ready'],
      ],
      'GET /topology names them, from kubernetes',
    )
    const res = await post(`${router.url}/v1/completions`, { model: 'handoff/sim-1', prompt: 'hello', max_tokens: 4 })
    t.equal(res.status, 200, res.text)
    const completions = async (sim: typeof prefillSim): Promise<number> => (await simRequests(sim)).filter((r) => r.path === '/v1/completions').length
    t.equal(await completions(prefillSim), 1, 'the prefill pod did the prefill')
    t.equal(await completions(decodeSim), 1, 'the decode pod decoded')

    // A request in flight on the prefiller holds it: not Ready must drain it, not drop it.
    router.app.topology.acquire(p)
    const t1 = performance.now()
    await kube.setPodStatus(ns, 'prefill-0', { ready: false, podIP: '127.0.0.2' })
    t.ok(await waitFor(() => router.view(p)?.draining === true, 2000), 'not Ready: draining')
    t.comment(`not Ready → draining in ${Math.round(performance.now() - t1)} ms`)
    t.equal(router.view(p)?.healthy, false, 'a draining pod gets no new work')
    const before = await completions(prefillSim)
    await post(`${router.url}/v1/completions`, { model: 'handoff/sim-1', prompt: 'again', max_tokens: 4 })
    t.equal(await completions(prefillSim), before, 'no new request reached the draining prefiller')
    router.app.topology.release(p)
    t.ok(await waitFor(() => !router.app.topology.has(p), 2000), 'drained: gone')
    t.ok(router.app.topology.has(d), 'the decoder stays')

    // Ready again: the pod joins anew.
    await kube.setPodStatus(ns, 'prefill-0', { ready: true, podIP: '127.0.0.2' })
    t.ok(await waitFor(() => router.view(p)?.healthy === true, 2000), 'Ready again: back')
  })

  t.test('terminating drains at once; deleted leaves, with peer_gone for its engine_id', async (t) => {
    const ns = await namespace(kube)
    const router = await startDiscoveringRouter(t, kube, ns, { prefill: { ...PREFILL, port: 9 } }, { probe: false })
    const id = podInstanceId(ns, 'p-0')
    await readyPod(kube, ns, 'p-0', 'prefill', '127.0.0.4')
    t.ok(await waitFor(() => router.app.topology.has(id), 2000), 'joined')
    router.app.topology.observeEngineId(id, 'engine-p0')
    router.app.topology.acquire(id)

    // kubectl delete: a graceful delete sets deletionTimestamp; the pod is still Ready.
    await kube.terminatePod(ns, 'p-0')
    t.ok(await waitFor(() => router.view(id)?.draining === true, 2000), 'terminating: draining at once')
    t.same(await peerGones(router.app), [], 'no peer_gone while something still holds it')
    // The kubelet confirms: the object goes away. The request in flight still holds the instance.
    await kube.deletePod(ns, 'p-0')
    await new Promise((r) => setTimeout(r, 300))
    t.ok(router.app.topology.has(id), 'deleted, but still drained through: its request is in flight')
    router.app.topology.release(id)
    t.ok(await waitFor(() => !router.app.topology.has(id), 2000), 'gone once drained')
    t.match(await peerGones(router.app), [{ engineIds: ['engine-p0'] }], 'peer_gone for its engine_id')

    // Deleted outright while idle: gone at once.
    const id1 = podInstanceId(ns, 'p-1')
    await readyPod(kube, ns, 'p-1', 'prefill', '127.0.0.5')
    t.ok(await waitFor(() => router.app.topology.has(id1), 2000), 'p-1 joined')
    await kube.deletePod(ns, 'p-1')
    t.ok(await waitFor(() => !router.app.topology.has(id1), 2000), 'p-1 deleted: gone')
  })

  // Issue 22: the engine pods publish their NIXL side-channel port; vLLM's logs name a peer by
  // that address, and connectors may know a peer by it only.
  t.test('a pod’s side-channel port annotation: peer_gone names the address, and an address finds the pod', async (t) => {
    const ns = await namespace(kube)
    // Probed: an address never names an engine that is up (nothing listens on port 9 here).
    const router = await startDiscoveringRouter(t, kube, ns, { prefill: { ...PREFILL, port: 9 } })
    const [a, b] = ['a-0', 'b-0'].map((n) => podInstanceId(ns, n)) as [string, string]
    await kube.createPod(ns, 'a-0', { labels: { app: 'engine', role: 'prefill' }, annotations: { 'handoff.dev/side-channel-port': '5600' } })
    await kube.setPodStatus(ns, 'a-0', { ready: true, podIP: '127.0.0.21' })
    await kube.createPod(ns, 'b-0', { labels: { app: 'engine', role: 'prefill' }, annotations: { 'handoff.dev/side-channel-port': 'not-a-port' } })
    await kube.setPodStatus(ns, 'b-0', { ready: true, podIP: '127.0.0.22' })
    t.ok(await waitFor(() => router.app.topology.has(a) && router.app.topology.has(b), 2000), 'both joined')
    t.equal(router.view(a)?.labels['handoff.dev/side-channel'], '127.0.0.21:5600', 'the instance carries podIP:port')
    t.equal(router.view(b)?.labels['handoff.dev/side-channel'], undefined, 'a malformed annotation is ignored')
    router.app.topology.observeEngineId(a, 'engine-a')
    router.app.topology.observeEngineId(b, 'engine-b')
    t.ok(await waitFor(() => router.view(a)?.healthy === false, 5000), 'a refuses its probes')

    // Ops name a dead engine by the address vLLM's logs show.
    const res = await post(`${router.url}/fault_tolerance/event`, { event_type: 'peer_gone', nodes: { addresses: ['127.0.0.21:5600'] }, reason: 'from the decoder logs' }, { authorization: `Bearer ${ADMIN}` })
    t.equal(res.status, 202, res.text)
    t.match(await peerGones(router.app), [{ engineIds: ['engine-a'], addresses: ['127.0.0.21:5600'] }], 'the address found the pod’s engine, and the event names the address')

    // Deleted: its drain's peer_gone lists the side channel too.
    await kube.deletePod(ns, 'b-0')
    t.ok(await waitFor(() => !router.app.topology.has(b), 2000), 'b gone')
    const last = (await peerGones(router.app)).at(-1) as { engineIds: string[]; addresses: string[] } | undefined
    t.same(last, { ...last, engineIds: ['engine-b'], addresses: [] }, 'b published no valid port: no address')
  })

  // Issue 39: an engine pod says where it publishes its KV events; the router follows them.
  t.test('a pod’s KV-events annotations become the instance’s kvEvents', async (t) => {
    const ns = await namespace(kube)
    const router = await startDiscoveringRouter(t, kube, ns, { prefill: { ...PREFILL, port: 9 } }, { probe: false })
    const [a, b] = ['kv-a', 'kv-b'].map((n) => podInstanceId(ns, n)) as [string, string]
    const annotations = { 'handoff.dev/kv-events-port': '5557', 'handoff.dev/kv-events-replay-port': '5558', 'handoff.dev/kv-events-topic': 'kv' }
    await kube.createPod(ns, 'kv-a', { labels: { app: 'engine', role: 'prefill' }, annotations })
    await kube.setPodStatus(ns, 'kv-a', { ready: true, podIP: '127.0.0.31' })
    await kube.createPod(ns, 'kv-b', { labels: { app: 'engine', role: 'prefill' }, annotations: { 'handoff.dev/kv-events-port': '70000' } })
    await kube.setPodStatus(ns, 'kv-b', { ready: true, podIP: '127.0.0.32' })
    t.ok(await waitFor(() => router.app.topology.has(a) && router.app.topology.has(b), 2000), 'both joined')
    t.same(router.app.topology.describe(a)?.kvEvents, { endpoint: 'tcp://127.0.0.31:5557', replayEndpoint: 'tcp://127.0.0.31:5558', topic: 'kv' }, 'the pod’s endpoints at its IP')
    t.equal(router.app.topology.describe(b)?.kvEvents, undefined, 'a malformed port is ignored')
    t.same(router.app.kv.following, [a], 'the router follows the one that publishes')
  })

  t.test('a pod recreated under the same name is a new incarnation: the old one is retired (peer_gone)', async (t) => {
    const ns = await namespace(kube)
    const router = await startDiscoveringRouter(t, kube, ns, { prefill: { ...PREFILL, port: 9 } }, { probe: false })
    const id = podInstanceId(ns, 'sts-0')
    await readyPod(kube, ns, 'sts-0', 'prefill', '127.0.0.6')
    t.ok(await waitFor(() => router.app.topology.has(id), 2000), 'joined')
    router.app.topology.observeEngineId(id, 'engine-old')
    // Something holds the old incarnation, so it would drain for ever were it not retired.
    router.app.topology.acquire(id)
    // A StatefulSet recreating its pod: the old object is gone (force-deleted), a new one under
    // the same name, new uid and IP, becomes Ready.
    await kube.deletePod(ns, 'sts-0')
    await readyPod(kube, ns, 'sts-0', 'prefill', '127.0.0.7')
    t.ok(await waitFor(() => router.view(id)?.url === 'http://127.0.0.7:9' && !router.view(id)?.draining, 3000), 'the new incarnation serves')
    t.match(await peerGones(router.app), [{ engineIds: ['engine-old'] }], 'peer_gone for the old engine_id')
    t.equal(router.view(id)?.engineId, undefined, 'the new incarnation has no engine_id yet')
    t.equal(router.view(id)?.inflight, 0, 'and none of the old one’s slots')
  })

  t.test('an API server restart loses nothing and leaves no phantom', async (t) => {
    const ns = await namespace(kube)
    const router = await startDiscoveringRouter(t, kube, ns, { prefill: { ...PREFILL, port: 9 }, decode: { ...DECODE, port: 9 } }, { probe: false })
    const discovery = router.app.discovery()
    const [a, b, c] = ['a-0', 'b-0', 'c-0'].map((n) => podInstanceId(ns, n)) as [string, string, string]
    await readyPod(kube, ns, 'a-0', 'prefill', '127.0.0.8')
    await readyPod(kube, ns, 'b-0', 'decode', '127.0.0.9')
    t.ok(await waitFor(() => router.app.topology.has(a) && router.app.topology.has(b), 2000), 'both joined')
    const lists = discovery?.stats().lists ?? 0

    await kube.stopApiServer()
    await new Promise((r) => setTimeout(r, 1000))
    t.ok(router.app.topology.has(a) && router.app.topology.has(b), 'API server down: the topology stays')
    t.notOk(router.view(a)?.draining || router.view(b)?.draining, 'and nothing drains')
    // Behind the API server's back, b's pod goes away.
    await kube.etcdDelete(`/registry/pods/${ns}/b-0`)
    await kube.startApiServer()
    t.comment(`API server restarted in ${kube.startSeconds.toFixed(1)} s`)

    t.ok(await waitFor(() => !router.app.topology.has(b), 10_000), 'b, deleted while nobody watched, is gone (no phantom)')
    t.ok(router.app.topology.has(a) && !router.view(a)?.draining, 'a stayed, never drained (nothing lost)')
    t.ok((discovery?.stats().watchErrors ?? 0) > 0, 'the watch failed while the API server was down')
    t.ok((discovery?.stats().lists ?? 0) > lists, 'and re-listed when it came back (410 Gone: its resourceVersion was too old)')
    await readyPod(kube, ns, 'c-0', 'decode', '127.0.0.10')
    t.ok(await waitFor(() => router.app.topology.has(c), 2000), 'the watch works again: a new Ready pod joins within 2 s')
    t.equal(router.app.topology.size, 2, 'exactly a and c')
  })

  // Issue 22, defect 4: a watch whose connection died without a reset (a node's network, a
  // load balancer's idle cut) stays open and silent; client-node's own watch has no timeout,
  // so the router missed every scale-up until it restarted. The API server is reached through
  // a TCP proxy that can blackhole the open connections while new ones pass.
  const throughProxy = async (t: Teardown, ns: string): Promise<{ kubeconfig: string; proxy: Awaited<ReturnType<typeof startTcpProxy>> }> => {
    const server = new URL(kube.server)
    const proxy = await startTcpProxy({ host: server.hostname, port: Number(server.port) }, (stop) => t.teardown(stop))
    const original = readFileSync(kube.kubeconfig('router', ns), 'utf8')
    if (!original.includes(kube.server)) throw new Error(`the kubeconfig does not name ${kube.server}`)
    const dir = mkdtempSync(join(tmpdir(), 'handoff-disc-'))
    t.teardown(() => rmSync(dir, { recursive: true, force: true }))
    const kubeconfig = join(dir, 'kubeconfig')
    writeFileSync(kubeconfig, original.replaceAll(kube.server, `https://127.0.0.1:${proxy.port}`))
    return { kubeconfig, proxy }
  }

  t.test('a watch that went silent is dropped after idleTimeoutMs and watched again: a pod Ready meanwhile joins', async (t) => {
    const ns = await namespace(kube)
    const { kubeconfig, proxy } = await throughProxy(t, ns)
    // The API server's own watch timeout is far away: only the idle timeout can end the watch.
    const router = await startDiscoveringRouter(t, kube, ns, { prefill: { ...PREFILL, port: 9 } }, { probe: false, kubeconfig, discovery: { idleTimeoutMs: 1500, watchTimeoutSeconds: 1800, relistIntervalMs: 0 } })
    const discovery = router.app.discovery()
    const [a, b] = ['a-0', 'b-0'].map((n) => podInstanceId(ns, n)) as [string, string]
    await readyPod(kube, ns, 'a-0', 'prefill', '127.0.0.11')
    t.ok(await waitFor(() => router.app.topology.has(a), 2000), 'a joined through the proxy')

    proxy.blackhole()
    proxy.heal() // new connections pass; the open watch stays silent, and no side is told
    const idleBefore = discovery?.stats().idleWatches ?? 0
    const t0 = performance.now()
    await readyPod(kube, ns, 'b-0', 'prefill', '127.0.0.12')
    t.ok(await waitFor(() => router.app.topology.has(b), 10_000), 'b, Ready while the watch was silent, joins')
    t.comment(`b joined ${Math.round(performance.now() - t0)} ms after it was Ready (idle timeout 1500 ms)`)
    t.ok((discovery?.stats().idleWatches ?? 0) > idleBefore, 'the silent watch was counted as idle')
    t.ok(router.logs.some((l) => l.msg === 'kubernetes discovery: pod watch silent: presumed dead, watching again'), 'and logged')
    t.ok(router.app.topology.has(a) && !router.view(a)?.draining, 'a stayed, never drained')
    const metrics = (await get(`${router.url}/metrics`)).text
    t.match(metrics, /handoff_router_discovery_idle_watches_total [1-9]/, 'GET /metrics counts it')
  })

  t.test('a periodic re-list finds what a silent watch missed, and disturbs nothing else', async (t) => {
    const ns = await namespace(kube)
    const { kubeconfig, proxy } = await throughProxy(t, ns)
    // No idle timeout within the test: only the re-list can find the changes.
    const router = await startDiscoveringRouter(t, kube, ns, { prefill: { ...PREFILL, port: 9 } }, { probe: false, kubeconfig, discovery: { idleTimeoutMs: 120_000, watchTimeoutSeconds: 1800, relistIntervalMs: 1500 } })
    const discovery = router.app.discovery()
    const [a, b, c] = ['a-0', 'b-0', 'c-0'].map((n) => podInstanceId(ns, n)) as [string, string, string]
    await readyPod(kube, ns, 'a-0', 'prefill', '127.0.0.13')
    await readyPod(kube, ns, 'c-0', 'prefill', '127.0.0.15')
    t.ok(await waitFor(() => router.app.topology.has(a) && router.app.topology.has(c), 2000), 'a and c joined')
    router.app.topology.observeEngineId(a, 'engine-a')
    t.ok(await waitFor(() => (discovery?.stats().relists ?? 0) >= 2, 5000), 're-lists run')
    t.notOk(router.view(c)?.draining, 'and a re-list that finds nothing new changes nothing')

    // Just after a re-list's list answered: the watch is what goes silent. (A list caught in
    // flight would hang until idleTimeoutMs, which this test sets out of reach: fr35.)
    const lists = discovery?.stats().lists ?? 0
    t.ok(await waitFor(() => (discovery?.stats().lists ?? 0) > lists, 5000), 'a re-list listed')
    proxy.blackhole()
    proxy.heal()
    const t0 = performance.now()
    await kube.deletePod(ns, 'a-0')
    await readyPod(kube, ns, 'b-0', 'prefill', '127.0.0.14')
    t.ok(await waitFor(() => router.app.topology.has(b) && !router.app.topology.has(a), 6000), 'the re-list found both: b joined, a (deleted unseen) is gone')
    t.comment(`found ${Math.round(performance.now() - t0)} ms after the changes (re-list every 1500 ms ±10 %)`)
    t.match(await peerGones(router.app), [{ engineIds: ['engine-a'] }], 'peer_gone for the deleted pod’s engine')
    t.ok(router.app.topology.has(c) && !router.view(c)?.draining, 'c stayed, never drained')
    t.equal(discovery?.stats().idleWatches, 0, 'no watch was dropped as idle: the re-list did it')
    t.match((await get(`${router.url}/metrics`)).text, /handoff_router_discovery_periodic_relists_total [1-9]/, 'GET /metrics counts the re-lists')
  })

  t.test('RBAC denial fails start-up with a clear RTR_ERR_CONFIG', async (t) => {
    const ns = await namespace(kube, false)
    const err = await startDiscoveringRouter(t, kube, ns, { prefill: { ...PREFILL, port: 9 } }, { user: 'nobody' }).then(
      () => undefined,
      (e: unknown) => e as Error & { code?: string },
    )
    t.equal(err?.code, 'RTR_ERR_CONFIG')
    t.match(err?.message, /RBAC denies listing and watching pods in namespace disc-.* \(403\): pods is forbidden: User "nobody" cannot list resource "pods"/)
    t.match(err?.message, /grant the router's service account get, list and watch on pods/)

    // The same through `handoff router`: start-up fails, exit 1, the reason on stderr.
    const config = writeConfig(t, {
      port: 0,
      discovery: { kind: 'kubernetes', namespace: ns, kubeconfig: kube.kubeconfig('nobody', ns), prefill: { ...PREFILL, port: 9 } },
    })
    const cli = await new Promise<{ code: number | null; stderr: string }>((resolve) => {
      execFile(process.execPath, [cliEntry, 'router', '--config', config], { timeout: 30_000 }, (e, _stdout, stderr) =>
        resolve({ code: e ? ((e as { code?: number }).code ?? null) : 0, stderr }),
      )
    })
    t.equal(cli.code, 1, 'handoff router exits 1')
    t.match(cli.stderr, /handoff: RTR_ERR_CONFIG: invalid router configuration: discovery: RBAC denies listing and watching pods/)
  })
})
