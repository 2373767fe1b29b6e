import { mkdtempSync, rmSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import pino from 'pino'
import t from 'tap'
import { buildApp } from '../../router/src/app.js'
import { loadConfig } from '../../router/src/config.js'
import { podInstanceId } from '../../router/src/discovery/kubernetes.js'
import { freePort } from '../../common/ports.js'
import { get, simRequests, waitFor } from '../helpers/cluster.js'
import { needKube, startKube } from '../helpers/kube.js'
import { complete, completionBody, startEngine, type Outcome } from '../helpers/pd-agents.js'
import { report } from '../helpers/decoder-stall.js'
import { needNixl, probeNixl } from '../native/helpers.js'

/*
 * Issue 17 item 6, a readiness blip is not death: a prefill pod found by Kubernetes discovery
 * goes NotReady and comes back Ready with the same engine. Out of routing meanwhile, but
 * never declared gone: before the fix the drain ended with peer_gone for its live engine_id,
 * the decoder's agent tombstoned it for 10 minutes, and every pull from the returned pod
 * failed with XFA_ERR_PEER_GONE. Real kube-apiserver (no kubelet: the test writes pod
 * status), real router with discovery, simulators and agents following the router.
 */

const probe = await probeNixl()
const LEASE_S = 5
const ADMIN = 'admin-token-flap-0'

t.test('a prefill pod that flaps NotReady → Ready serves P/D again at once', { skip: needKube(t) || needNixl(t, probe) }, async (t) => {
  const kube = await startKube(t)
  const ns = `flap-${process.pid}`
  await kube.createNamespace(ns)
  await kube.grantPodReader(ns, 'router')
  const [pPort, dPort] = [await freePort(), await freePort()]
  const dir = mkdtempSync(join(tmpdir(), 'handoff-flap-'))
  t.teardown(() => rmSync(dir, { recursive: true, force: true }))
  const file = join(dir, 'router.json')
  writeFileSync(
    file,
    JSON.stringify({
      port: 0,
      adminToken: ADMIN,
      leases: { leaseSeconds: LEASE_S },
      health: { intervalMs: 200, timeoutMs: 500 },
      discovery: {
        kind: 'kubernetes',
        namespace: ns,
        kubeconfig: kube.kubeconfig('router', ns),
        backoffMs: 100,
        maxBackoffMs: 1000,
        prefill: { selector: 'app=engine,role=prefill', port: pPort },
        decode: { selector: 'app=engine,role=decode', port: dPort },
      },
    }),
  )
  const app = await buildApp({ config: loadConfig({ file }), logger: pino({ level: 'warn' }) })
  t.teardown(() => app.close())
  const url = await app.listen({ host: '127.0.0.1', port: 0 })
  const agentArgs = ['--router-url', url]
  // Each pod has its own loopback address; a role's port is the same in every pod.
  const pods = [
    { name: 'prefill-a', role: 'prefill' as const, ip: '127.0.0.2', port: pPort },
    { name: 'prefill-b', role: 'prefill' as const, ip: '127.0.0.3', port: pPort },
    { name: 'decode-0', role: 'decode' as const, ip: '127.0.0.4', port: dPort },
  ]
  const engines = await Promise.all(
    pods.map((p) =>
      startEngine(t, {
        role: p.role,
        leaseSeconds: LEASE_S,
        agentArgs,
        simArgs: ['--host', p.ip, '--port', String(p.port), ...(p.role === 'decode' ? ['--kv-load-failure-policy', 'fail'] : [])],
      }),
    ),
  )
  for (const p of pods) {
    await kube.createPod(ns, p.name, { labels: { app: 'engine', role: p.role } })
    await kube.setPodStatus(ns, p.name, { ready: true, podIP: p.ip })
  }
  const a = podInstanceId(ns, 'prefill-a')
  const view = (id: string) => app.topology.snapshot().instances.find((i) => i.id === id)
  t.ok(await waitFor(() => pods.every((p) => view(podInstanceId(ns, p.name))?.healthy === true), 10_000), 'every pod is a healthy instance')
  const outcomes: Outcome[] = []
  const run = async (n: number, tag: string): Promise<void> => {
    for (let i = 0; i < n; i++) outcomes.push(await complete(url, completionBody(outcomes.length, tag), outcomes.length, 30_000))
  }
  await run(8, 'before')
  t.ok(await waitFor(() => view(a)?.engineId !== undefined, 10_000), "prefill-a's engine_id is known")
  const engineA = view(a)?.engineId as string

  // The blip: NotReady (the engine itself never stopped), then Ready again.
  await kube.setPodStatus(ns, 'prefill-a', { ready: false, podIP: '127.0.0.2' })
  t.ok(await waitFor(() => !app.topology.has(a), 5000), 'NotReady: out of routing')
  await run(6, 'blip')
  const servedBefore = (await simRequests(engines[0]!.sim)).filter((r) => r.path === '/v1/completions').length
  await kube.setPodStatus(ns, 'prefill-a', { ready: true, podIP: '127.0.0.2' })
  t.ok(await waitFor(() => view(a)?.healthy === true, 5000), 'Ready again: back in routing')
  await run(30, 'after')

  const s = report(t, 'prefill pod flapped NotReady → Ready', outcomes)
  t.ok(s.requests >= 30, `at least 30 requests (${s.requests})`)
  t.equal(s.wrong, 0, 'no wrong text')
  t.equal(s.failed, 0, 'no request failed: pulls from the returned pod work')
  const servedAfter = (await simRequests(engines[0]!.sim)).filter((r) => r.path === '/v1/completions').length
  t.ok(servedAfter > servedBefore, `the returned pod prefilled again (${servedAfter - servedBefore} requests)`)
  await app.events.settled()
  const gone = (await app.events.store.since(0)).filter((e) => e.type === 'peer_gone') as unknown as { engineIds: string[] }[]
  t.notOk(gone.some((e) => e.engineIds.includes(engineA)), 'its engine_id was never declared gone')
  const decoderPeers = (await get(`${engines[2]!.agent.url}/v1/status`)).json<{ peers: { engineId: string; state: string }[] }>().peers
  t.ok(decoderPeers.some((p) => p.engineId === engineA && p.state === 'ready'), "the decoder's agent still holds prefill-a's handshake")
})
