import { once } from 'node:events'
import { createServer } from 'node:http'
import type { AddressInfo } from 'node:net'
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import t from 'tap'
import { request } from 'undici'
import { spawnService } from '../../common/spawn.js'
import { runPrestopHook } from '../../bench/prestop-hook.js'
import { freePort } from '../../common/ports.js'
import { get } from '../helpers/cluster.js'
import { complete, completionBody, sleep, startEngine, stuckRequest, tally, within, type Outcome } from '../helpers/pd-agents.js'
import { needNixl, probeNixl } from '../native/helpers.js'

/*
 * Issue 11: the chart's preStop hook (deploy/helm/handoff/files/prestop-drain.py) against a
 * real router process and simulators with their transfer agents. The prefiller the script
 * drains has the id Kubernetes discovery would give its pod (`k8s:<namespace>:<pod>`), and
 * the script works it out from POD_NAMESPACE/POD_NAME as in the pod. Under load, with
 * leases held open (the decoder's agent stopped for a while), it must return 0 only after the
 * router's /leases shows no unread lease of that prefiller and /topology nothing in flight,
 * while no client request fails (a second prefiller takes the new work).
 */
const LEASE_S = 10
const ADMIN = 'admin-token-prestop-0123'
const admin = { authorization: `Bearer ${ADMIN}` }
const NS = 'llm'
const P0 = `k8s:${NS}:prefill-0`
const probe = await probeNixl()

interface LeaseView {
  byPrefill: Record<string, number>
}
interface TopologyView {
  instances: { id: string; inflight: number }[]
}

t.test('the preStop drain script against a real router', { skip: needNixl(t, probe) }, async (t) => {
  const routerPort = await freePort()
  const routerUrl = `http://127.0.0.1:${routerPort}`
  const agentArgs = ['--router-url', routerUrl]
  const [p0, p1, p2, d0] = await Promise.all([
    startEngine(t, { role: 'prefill', leaseSeconds: LEASE_S, agentArgs, simArgs: ['--prefill-delay-ms', '30'] }),
    startEngine(t, { role: 'prefill', leaseSeconds: LEASE_S, agentArgs, simArgs: ['--prefill-delay-ms', '30'] }),
    startEngine(t, { role: 'prefill', leaseSeconds: LEASE_S, agentArgs, simArgs: ['--prefill-delay-ms', '30'] }),
    startEngine(t, { role: 'decode', leaseSeconds: LEASE_S, agentArgs }),
  ])
  // Static instances under the ids discovery would give the pods.
  const dir = mkdtempSync(join(tmpdir(), 'handoff-prestop-'))
  t.teardown(() => rmSync(dir, { recursive: true, force: true }))
  const config = join(dir, 'router.json')
  const ids = { [P0]: p0, [`k8s:${NS}:prefill-1`]: p1, [`k8s:${NS}:prefill-2`]: p2, [`k8s:${NS}:decode-0`]: d0 }
  writeFileSync(
    config,
    JSON.stringify({
      port: routerPort,
      logLevel: 'warn',
      leases: { leaseSeconds: LEASE_S },
      instances: Object.entries(ids).map(([id, e]) => ({ id, role: e.opts.role, url: e.sim.url })),
    }),
  )
  const router = await spawnService({ args: ['router', '--config', config], env: { ...process.env, HANDOFF_ADMIN_TOKEN: ADMIN } })
  t.teardown(() => router.stop())
  const tokenFile = join(dir, 'admin-token')
  writeFileSync(tokenFile, `${ADMIN}\n`)
  const podEnv = (pod: string): Record<string, string> => ({ POD_NAMESPACE: NS, POD_NAME: pod, HANDOFF_ADMIN_TOKEN_FILE: tokenFile })

  t.ok(
    (await within(10_000, async () => {
      const statuses = await Promise.all([p0, p1, p2, d0].map(async (e) => (await get(`${e.agent.url}/v1/status`)).json<{ router: { connected: boolean } }>()))
      return statuses.every((s) => s.router.connected)
    })) >= 0,
    "every agent follows the router's log",
  )
  for (let i = 0; i < 6; i++) t.ok((await complete(router.url, completionBody(i, 'warm'), i)).ok, 'warm-up request')

  t.test('an instance the router does not know: exit 0 at once', async (t) => {
    const started = performance.now()
    const run = await runPrestopHook(['--router-url', router.url, '--deadline-seconds', '20'], podEnv('not-there')).done
    t.equal(run.code, 0, run.stderr)
    t.match(run.stderr, /k8s:llm:not-there is not known to .* \(404\)/)
    t.ok(performance.now() - started < 5000, 'at once')
  })

  t.test('a dead first router URL: the script goes on to the next', async (t) => {
    const dead = `http://127.0.0.1:${await freePort()}`
    const run = await runPrestopHook(['--router-url', `${dead},${router.url}`, '--deadline-seconds', '20'], podEnv('not-there-either')).done
    t.equal(run.code, 0, run.stderr)
    t.match(run.stderr, new RegExp(`${dead}: .*[Rr]efused`), 'the dead one was tried first')
    t.match(run.stderr, new RegExp(`not known to ${router.url}`), 'the second one answered')
  })

  t.test('every router dead: exit 2 after the retries', async (t) => {
    const dead = `http://127.0.0.1:${await freePort()}`
    const run = await runPrestopHook(['--router-url', dead, '--deadline-seconds', '20', '--retries', '2'], podEnv('prefill-0')).done
    t.equal(run.code, 2, run.stderr)
    t.match(run.stderr, /FAILED: no router reachable after 2 rounds/)
  })

  t.test('a wrong admin token: exit 4 with the reason', async (t) => {
    const run = await runPrestopHook(['--router-url', router.url], { POD_NAMESPACE: NS, POD_NAME: 'prefill-0', HANDOFF_ADMIN_TOKEN: 'wrong-token-123' }).done
    t.equal(run.code, 4, run.stderr)
    t.match(run.stderr, /answered 401/)
    t.match(run.stderr, /FAILED: every router refused/)
  })

  t.test('draining a prefiller under load: exit 0 only once nothing of it is left', async (t) => {
    const outcomes: Outcome[] = []
    let stop = false
    const worker = async (w: number): Promise<void> => {
      for (let i = 0; !stop; i++) outcomes.push(await complete(router.url, completionBody(w * 1000 + i, 'drain'), w * 1000 + i))
    }
    const load = Promise.all([0, 1, 2, 3, 4, 5].map(worker))

    // What the router holds of P0, polled all along: the send time of the last poll that
    // saw any (the state was non-zero at or after it).
    let lastHeld = -1
    let sawLeases = 0
    let sawInflight = 0
    let polling = true
    const poller = (async () => {
      while (polling) {
        const sent = performance.now()
        const [leases, topo] = await Promise.all([
          get(`${router.url}/leases?instance=${P0}`, admin).then((r) => r.json<LeaseView>()),
          get(`${router.url}/topology`, admin).then((r) => r.json<TopologyView>()),
        ]).catch(() => [undefined, undefined] as const)
        if (leases && topo) {
          const unread = leases.byPrefill[P0] ?? 0
          const inflight = topo.instances.find((i) => i.id === P0)?.inflight ?? 0
          if (unread > 0 || inflight > 0) lastHeld = sent
          sawLeases = Math.max(sawLeases, unread)
          sawInflight = Math.max(sawInflight, inflight)
        }
        await sleep(5)
      }
    })()

    await sleep(300)
    // Hold leases open: the decoder's agent cannot READ while it is stopped, so P0's
    // answered prefills stay unread until it goes on.
    d0.agent.child.kill('SIGSTOP')
    let stopped = true
    t.teardown(() => {
      if (stopped) d0.agent.child.kill('SIGCONT')
    })
    // Each worker now waits on the stopped decoder with one request, prefilled at one of three
    // prefillers: with six, none at P0 one run in eleven ((2/3)^6; fr26). More requests, each
    // also held at the decoder, until one is P0's.
    const extra: Promise<void>[] = []
    const p0Unread = async (): Promise<boolean> => ((await get(`${router.url}/leases?instance=${P0}`, admin)).json<LeaseView>().byPrefill[P0] ?? 0) > 0
    const heldAtP0 = await within(10_000, async () => {
      if (await p0Unread()) return true
      const i = 9000 + extra.length
      if (extra.length < 30) extra.push(complete(router.url, completionBody(i, 'drain'), i).then((o) => void outcomes.push(o)))
      await sleep(100)
      return false
    })
    t.ok(heldAtP0 >= 0, `P0 has unread leases (${extra.length} request(s) more sent to get there)`)
    const started = performance.now()
    const hook = runPrestopHook(['--router-url', router.url, '--deadline-seconds', '30', '--progress-seconds', '0.3'], podEnv('prefill-0'))
    await sleep(1500)
    t.ok(hook.running(), 'the script still blocks while P0 has unread leases')
    d0.agent.child.kill('SIGCONT')
    stopped = false
    const run = await hook.done
    const afterDrain = outcomes.length
    await sleep(300)
    stop = true
    await Promise.all([load, ...extra])
    polling = false
    await poller

    t.equal(run.code, 0, run.stderr)
    t.ok(sawLeases > 0, `the poller saw P0 hold unread leases (up to ${sawLeases}; in flight up to ${sawInflight})`)
    t.ok(lastHeld >= 0 && lastHeld < run.exitedAt, `the last sight of anything held at P0 (${Math.round(lastHeld - started)} ms) came before the script's exit (${Math.round(run.exitedAt - started)} ms)`)
    t.match(run.stderr, /draining k8s:llm:prefill-0 via/)
    t.match(run.stderr, /waiting for k8s:llm:prefill-0: \d+ in flight, [1-9]\d* unread lease\(s\)/, 'a progress line said what was left')
    // Drained while the script waited, or between two of its polls (the router then forgets it: 404).
    t.match(run.stderr, /k8s:llm:prefill-0 (drained after|gone from .* \(404: drained and removed)/)
    const tl = tally(outcomes)
    t.ok(outcomes.length > afterDrain, 'traffic went on after the drain')
    t.same({ failed: tl.failed, wrong: tl.wrong, codes: tl.codes }, { failed: 0, wrong: 0, codes: {} }, `${tl.requests} requests, all ok`)
    const left = (await get(`${p0.sim.url}/sim/info`)).json<{ leases: number; usedBlocks: number }>()
    t.same({ leases: left.leases, usedBlocks: left.usedBlocks }, { leases: 0, usedBlocks: 0 }, 'the drained prefiller holds nothing')
    const topo = (await get(`${router.url}/topology`, admin)).json<TopologyView>()
    t.notOk(
      topo.instances.some((i) => i.id === P0),
      'gone from the topology',
    )
    t.comment(`drain under load: script exited ${Math.round(run.exitedAt - started)} ms after it started; ${tl.requests} requests`)
  })

  t.test('a lease that cannot end before the deadline: exit 1 with what was left', async (t) => {
    const stuck = stuckRequest(t, router.url, d0, completionBody(9000, 'stuck'))
    let holder = ''
    t.ok(
      (await within(5000, async () => {
        const s = (await get(`${router.url}/leases`, admin)).json<LeaseView>()
        holder = Object.keys(s.byPrefill)[0] ?? ''
        return holder !== ''
      })) >= 0,
      'a lease is held',
    )
    const pod = holder.split(':')[2] ?? ''
    const started = performance.now()
    const run = await runPrestopHook(['--router-url', router.url, '--deadline-seconds', '1.5', '--progress-seconds', '0.5'], podEnv(pod)).done
    const took = performance.now() - started
    t.equal(run.code, 1, run.stderr)
    t.match(run.stderr, new RegExp(`FAILED: deadline \\(1.5 s\\) passed with ${holder} not drained: \\d+ in flight, 1 unread lease\\(s\\)`))
    t.ok(took >= 1400 && took < 6000, `it gave up at the deadline (${Math.round(took)} ms)`)
    stuck.abort()
    t.equal(await stuck.pending, 'AbortError')
    stuck.resume()
  })

  t.test('the instance is removed while the script waits: exit 0, saying so', async (t) => {
    const stuck = stuckRequest(t, router.url, d0, completionBody(9001, 'gone'))
    let holder = ''
    t.ok(
      (await within(5000, async () => {
        holder = Object.keys((await get(`${router.url}/leases`, admin)).json<LeaseView>().byPrefill)[0] ?? ''
        return holder !== ''
      })) >= 0,
      'a lease is held',
    )
    const script = runPrestopHook(['--router-url', router.url, '--deadline-seconds', '20', '--progress-seconds', '0.3'], podEnv(holder.split(':')[2] ?? ''))
    t.ok((await within(5000, async () => script.stderr().includes(`waiting for ${holder}`))) >= 0, 'the script waits on the held lease')
    const del = await request(`${router.url}/admin/instances/${encodeURIComponent(holder)}`, { method: 'DELETE', headers: admin })
    t.equal(del.statusCode, 200)
    await del.body.dump()
    const run = await script.done
    t.equal(run.code, 0, run.stderr)
    // Removed during a poll (the waiting call answers `removed`) or between two (the next one gets 404).
    t.match(run.stderr, new RegExp(`${holder} (removed after [\\d.]+ s: the router no longer routes to it|gone from .* \\(404: drained and removed between two polls, or removed\\))`))
    t.notMatch(run.stderr, /no unread lease|is not known to/, 'neither claimed drained nor an instance the router never knew')
    stuck.abort()
    await stuck.pending
    stuck.resume()
  })
})

/** A stub router at a loopback URL: `answer` gives each drain call's status and body, in order (1, 2, …). */
async function stubRouter(t: { teardown(fn: () => void): void }, answer: (call: number) => [number, unknown]): Promise<{ url: string; calls(): number }> {
  let calls = 0
  const server = createServer((req, res) => {
    req.resume()
    const [status, body] = answer(++calls)
    res.writeHead(status, { 'content-type': 'application/json' }).end(JSON.stringify(body))
  })
  server.listen(0, '127.0.0.1')
  await once(server, 'listening')
  t.teardown(() => server.close())
  return { url: `http://127.0.0.1:${(server.address() as AddressInfo).port}`, calls: () => calls }
}

t.test('a router that forgets the instance between two polls (404 after it answered): exit 0, not "never known"', async (t) => {
  // The race the real router gives at random (the drain ends while no call waits, and the
  // instance is removed): a stub answering the router's own shapes makes it certain.
  const { url, calls } = await stubRouter(t, (call) =>
    call === 1
      ? [200, { id: P0, drained: false, removed: false, inflight: 0, unreadLeases: 1 }]
      : [404, { error: { message: `instance ${P0} is not in the topology`, type: 'not_found_error', param: null, code: 'RTR_ERR_INSTANCE_NOT_FOUND' } }],
  )
  const run = await runPrestopHook(['--router-url', url, '--deadline-seconds', '10', '--progress-seconds', '0.2'], { POD_NAMESPACE: NS, POD_NAME: 'prefill-0', HANDOFF_ADMIN_TOKEN: ADMIN }).done
  t.equal(run.code, 0, run.stderr)
  t.equal(calls(), 2)
  t.match(run.stderr, /waiting for k8s:llm:prefill-0: 0 in flight, 1 unread lease/)
  t.match(run.stderr, new RegExp(`k8s:llm:prefill-0 gone from ${url} after [\\d.]+ s \\(404: drained and removed between two polls, or removed\\): nothing routes to it`))
  t.notMatch(run.stderr, /is not known to/)
})

// Issue 22 defect 3: the script gave up after 5 rounds without an answer (about 7 s) although
// its deadline was far: a Redis failover (503 from every router) or a router rollout during a
// scale-down ended undrained. By default it now retries until its deadline.
t.test('routers that answer 503 for 8 s (a Redis failover): the script waits them out, then drains', async (t) => {
  const started = Date.now()
  const { url, calls } = await stubRouter(t, () =>
    Date.now() - started < 8000
      ? [503, { error: { message: 'the shared store is unavailable', type: 'service_unavailable', param: null, code: 'RTR_ERR_STORE_UNAVAILABLE' } }]
      : [200, { id: P0, drained: true, removed: false, inflight: 0, unreadLeases: 0 }],
  )
  const run = await runPrestopHook(['--router-url', url, '--deadline-seconds', '30', '--progress-seconds', '0.5'], { POD_NAMESPACE: NS, POD_NAME: 'prefill-0', HANDOFF_ADMIN_TOKEN: ADMIN }).done
  t.equal(run.code, 0, run.stderr)
  t.ok(calls() > 5, `it kept asking (${calls()} calls)`)
  t.match(run.stderr, /HTTP 503/)
  t.match(run.stderr, /k8s:llm:prefill-0 drained after/)
})

t.test('a drain waiting on a router that has not heard of it yet says so while it waits', async (t) => {
  // With several routers on Redis, one that has not yet said what it has in flight holds the
  // drain (drainer.ts): the router's answer counts them, and the script's progress shows it.
  const { url } = await stubRouter(t, (call) =>
    call === 1
      ? [200, { id: P0, drained: false, removed: false, inflight: 0, unreadLeases: 0, unheardRouters: 1 }]
      : [200, { id: P0, drained: true, removed: true, inflight: 0, unreadLeases: 0 }],
  )
  const run = await runPrestopHook(['--router-url', url, '--deadline-seconds', '10', '--progress-seconds', '0.2'], { POD_NAMESPACE: NS, POD_NAME: 'prefill-0', HANDOFF_ADMIN_TOKEN: ADMIN }).done
  t.equal(run.code, 0, run.stderr)
  t.match(run.stderr, /waiting for k8s:llm:prefill-0: 0 in flight, 0 unread lease\(s\), 1 router\(s\) not yet heard from/)
  t.match(run.stderr, /k8s:llm:prefill-0 drained after/)
})
