import { type ChildProcess, execFile, spawn, spawnSync } from 'node:child_process'
import { existsSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { setTimeout as sleep } from 'node:timers/promises'
import { promisify } from 'node:util'
import { Agent, request } from 'undici'
import { freePort } from '../../common/ports.js'
import type { Teardown } from './cluster.js'
import { packageRoot } from '../../common/paths.js'
import { versionsFile } from '../../common/versions.js'
import { missing } from './need.js'

/**
 * A real Kubernetes API server for tests (issue 11): Debian's etcd and a kube-apiserver built
 * by scripts/k8s-tools.sh, on free loopback ports, TLS with a throwaway CA, static bearer
 * tokens and RBAC. There is no scheduler, kubelet or controller-manager: tests create the
 * namespace's `default` ServiceAccount, create pods already bound to a made-up node, and
 * write pod status (Ready, podIP) themselves, as a kubelet would.
 */

const root = packageRoot
const run = promisify(execFile)

export const KUBE_VERSION = versionsFile('k8s-versions').KUBE_VERSION ?? 'unknown'
/** Where scripts/k8s-tools.sh leaves kube-apiserver, kubectl and helm. */
export const kubeBinDir = join(root, '.cache/k8s', KUBE_VERSION)

/**
 * tap's `skip` for tests that need the API server: the reason (with the command that builds
 * the binaries) when they are missing, false when they are there. Under CI a missing binary is
 * a failure, never a skip.
 */
export function needKube(t: { fail(message: string): void }, opts: { helm?: boolean } = {}): string | false {
  const absent: string[] = []
  if (spawnSync('etcd', ['--version'], { stdio: 'ignore' }).status !== 0) absent.push('etcd (apt-get install etcd-server)')
  for (const bin of ['kube-apiserver', 'kubectl', ...(opts.helm ? ['helm'] : [])]) {
    if (!existsSync(join(kubeBinDir, bin))) absent.push(join(kubeBinDir, bin))
  }
  if (absent.length === 0) return false
  return missing(t, `${absent.join(', ')} not found: run scripts/k8s-tools.sh (builds kube-apiserver ${KUBE_VERSION}, minutes the first time)`)
}

/** Bearer tokens the API server accepts (its static token file). */
export const TOKENS = {
  /** system:masters: everything. */
  admin: 'admin-token-0123456789',
  /** User `router`: nothing until a test grants it (see `grantPodReader`), as the chart's service account. */
  router: 'router-token-0123456789',
  /** User `nobody`: never granted anything; RBAC denies it all. */
  nobody: 'nobody-token-0123456789',
} as const
export type KubeUser = keyof typeof TOKENS

export interface PodSpec {
  labels?: Record<string, string>
  annotations?: Record<string, string>
  /** Default: a made-up node, so a plain delete is graceful (the pod lingers, terminating), as on a real node. */
  nodeName?: string
}

export interface PodStatus {
  ready: boolean
  podIP?: string
}

export interface LocalKube {
  /** https://127.0.0.1:<port> */
  server: string
  /** Seconds the last API server start took until /readyz answered 200. */
  readonly startSeconds: number
  /** A kubeconfig file for `user` (written once, in the temp dir). */
  kubeconfig(user?: KubeUser, namespace?: string): string
  /** The API server goes away (SIGTERM, SIGKILL after 5 s); etcd and its data stay. */
  stopApiServer(): Promise<void>
  /** Starts it again, same port and flags; resolves once /readyz says ok. */
  startApiServer(): Promise<void>
  /** A JSON request to the API server as `user` (admin by default); rejects on a status >= 400 unless `allow` lists it. */
  api<T = Record<string, unknown>>(method: string, path: string, opts?: { body?: unknown; contentType?: string; user?: KubeUser; allow?: number[] }): Promise<{ status: number; body: T }>
  /** A namespace and its `default` ServiceAccount (no controller-manager makes it). */
  createNamespace(name: string): Promise<void>
  /** Role + RoleBinding: `user` may get, list and watch pods in `namespace` (the chart's RBAC). */
  grantPodReader(namespace: string, user: KubeUser): Promise<void>
  createPod(namespace: string, name: string, spec?: PodSpec): Promise<Record<string, unknown>>
  /** Writes what a kubelet would: phase Running, the Ready condition, podIP. */
  setPodStatus(namespace: string, name: string, status: PodStatus): Promise<void>
  /** A graceful delete: deletionTimestamp set, the pod stays (nothing finishes it) until `deletePod`. */
  terminatePod(namespace: string, name: string): Promise<void>
  /** Gone now (grace period 0, what the kubelet does once the containers stopped). */
  deletePod(namespace: string, name: string): Promise<void>
  /** Deletes a key straight from etcd, behind the API server's back (while it is down, say). */
  etcdDelete(key: string): Promise<void>
  /** Runs the kubectl built beside kube-apiserver, as `user`. */
  kubectl(args: string[], user?: KubeUser): Promise<{ stdout: string; stderr: string }>
  /** Runs helm (built by scripts/k8s-tools.sh) against this API server, as admin. */
  helm(args: string[]): Promise<{ stdout: string; stderr: string }>
}

/** Starts etcd and kube-apiserver; both are killed and their files removed when the test ends. */
export async function startKube(t: Teardown): Promise<LocalKube> {
  // tmpfs: etcd fsyncs every write, which on a shared disk makes each test slower for nothing.
  const dir = mkdtempSync(join(existsSync('/dev/shm') ? '/dev/shm' : tmpdir(), 'handoff-kube-'))
  const children = new Set<ChildProcess>()
  t.teardown(async () => {
    await Promise.all([...children].map((c) => kill(c, 2000)))
    rmSync(dir, { recursive: true, force: true })
  })

  await makeCerts(dir)
  writeFileSync(
    join(dir, 'tokens.csv'),
    [`${TOKENS.admin},admin,admin,"system:masters"`, `${TOKENS.router},router,router`, `${TOKENS.nobody},nobody,nobody`].join('\n') + '\n',
  )
  const ca = readFileSync(join(dir, 'ca.crt'))
  const dispatcher = new Agent({ connect: { ca }, connections: 4 })
  t.teardown(() => dispatcher.close())

  // etcd: client and peer ports on loopback, data on tmpfs.
  const [etcdPort, peerPort, apiPort] = [await freePort(), await freePort(), await freePort()]
  const etcdUrl = `http://127.0.0.1:${etcdPort}`
  const etcd = spawnLogged(
    'etcd',
    [
      '--name=test',
      `--data-dir=${join(dir, 'etcd')}`,
      `--listen-client-urls=${etcdUrl}`,
      `--advertise-client-urls=${etcdUrl}`,
      `--listen-peer-urls=http://127.0.0.1:${peerPort}`,
      `--initial-advertise-peer-urls=http://127.0.0.1:${peerPort}`,
      `--initial-cluster=test=http://127.0.0.1:${peerPort}`,
      '--log-level=warn',
    ],
    join(dir, 'etcd.log'),
  )
  children.add(etcd.child)
  await waitFor(`etcd on ${etcdPort}`, etcd, 20_000, async () => {
    const res = await request(`${etcdUrl}/health`, { signal: AbortSignal.timeout(1000) })
    const text = await res.body.text()
    return res.statusCode === 200 && text.includes('true')
  })

  const server = `https://127.0.0.1:${apiPort}`
  const apiArgs = [
    `--etcd-servers=${etcdUrl}`,
    '--bind-address=127.0.0.1',
    '--advertise-address=127.0.0.1',
    `--secure-port=${apiPort}`,
    `--cert-dir=${dir}`,
    `--tls-cert-file=${join(dir, 'server.crt')}`,
    `--tls-private-key-file=${join(dir, 'server.key')}`,
    `--token-auth-file=${join(dir, 'tokens.csv')}`,
    '--authorization-mode=RBAC',
    // Required since service-account tokens became bound tokens; nothing here issues any.
    '--service-account-issuer=https://kubernetes.default.svc',
    `--service-account-key-file=${join(dir, 'sa.pub')}`,
    `--service-account-signing-key-file=${join(dir, 'sa.key')}`,
    '--service-cluster-ip-range=10.96.0.0/24',
    // No node will ever hold the `kubernetes` Service's endpoint; and fewer moving parts start.
    '--endpoint-reconciler-type=none',
    '--enable-priority-and-fairness=false',
    '--profiling=false',
    '--v=1',
  ]
  let api: ReturnType<typeof spawnLogged> | undefined
  let startSeconds = 0

  const call: LocalKube['api'] = async (method, path, opts = {}) => {
    const res = await request(`${server}${path}`, {
      method: method as 'GET',
      dispatcher,
      headers: {
        authorization: `Bearer ${TOKENS[opts.user ?? 'admin']}`,
        accept: 'application/json',
        ...(opts.body !== undefined ? { 'content-type': opts.contentType ?? 'application/json' } : {}),
      },
      ...(opts.body !== undefined ? { body: JSON.stringify(opts.body) } : {}),
      signal: AbortSignal.timeout(10_000),
    })
    const text = await res.body.text()
    let body: unknown = text
    try {
      body = JSON.parse(text)
    } catch {
      // /readyz and friends answer text
    }
    if (res.statusCode >= 400 && !(opts.allow ?? []).includes(res.statusCode)) {
      throw new Error(`${method} ${path}: HTTP ${res.statusCode}: ${text.slice(0, 500)}`)
    }
    return { status: res.statusCode, body: body as never }
  }

  const startApiServer = async (): Promise<void> => {
    if (api && api.child.exitCode === null) return
    const started = performance.now()
    api = spawnLogged(join(kubeBinDir, 'kube-apiserver'), apiArgs, join(dir, 'kube-apiserver.log'))
    children.add(api.child)
    await waitFor(`kube-apiserver on ${apiPort}`, api, 90_000, async () => {
      const res = await call('GET', '/readyz', { allow: [500, 503, 401, 403] })
      return res.status === 200
    })
    startSeconds = (performance.now() - started) / 1000
  }
  const stopApiServer = async (): Promise<void> => {
    const a = api
    api = undefined
    if (!a) return
    await kill(a.child, 5000)
    children.delete(a.child)
  }
  await startApiServer()

  const kubeconfigs = new Map<string, string>()
  const kubeconfig = (user: KubeUser = 'admin', namespace = 'default'): string => {
    const key = `${user}/${namespace}`
    let file = kubeconfigs.get(key)
    if (file) return file
    file = join(dir, `kubeconfig-${user}-${namespace}.json`)
    // JSON is YAML: client-node and kubectl both read it.
    writeFileSync(
      file,
      JSON.stringify({
        apiVersion: 'v1',
        kind: 'Config',
        clusters: [{ name: 'test', cluster: { server, 'certificate-authority': join(dir, 'ca.crt') } }],
        users: [{ name: user, user: { token: TOKENS[user] } }],
        contexts: [{ name: 'test', context: { cluster: 'test', user, namespace } }],
        'current-context': 'test',
      }),
    )
    kubeconfigs.set(key, file)
    return file
  }

  const podPath = (ns: string, name: string): string => `/api/v1/namespaces/${ns}/pods/${name}`

  return {
    server,
    get startSeconds() {
      return startSeconds
    },
    kubeconfig,
    stopApiServer,
    startApiServer,
    api: call,
    async createNamespace(name) {
      await call('POST', '/api/v1/namespaces', { body: { apiVersion: 'v1', kind: 'Namespace', metadata: { name } } })
      await call('POST', `/api/v1/namespaces/${name}/serviceaccounts`, { body: { apiVersion: 'v1', kind: 'ServiceAccount', metadata: { name: 'default' } } })
    },
    async grantPodReader(namespace, user) {
      const name = `pod-reader-${user}`
      await call('POST', `/apis/rbac.authorization.k8s.io/v1/namespaces/${namespace}/roles`, {
        body: {
          apiVersion: 'rbac.authorization.k8s.io/v1',
          kind: 'Role',
          metadata: { name },
          rules: [{ apiGroups: [''], resources: ['pods'], verbs: ['get', 'list', 'watch'] }],
        },
      })
      await call('POST', `/apis/rbac.authorization.k8s.io/v1/namespaces/${namespace}/rolebindings`, {
        body: {
          apiVersion: 'rbac.authorization.k8s.io/v1',
          kind: 'RoleBinding',
          metadata: { name },
          roleRef: { apiGroup: 'rbac.authorization.k8s.io', kind: 'Role', name },
          subjects: [{ apiGroup: 'rbac.authorization.k8s.io', kind: 'User', name: user }],
        },
      })
    },
    async createPod(namespace, name, spec = {}) {
      const res = await call('POST', `/api/v1/namespaces/${namespace}/pods`, {
        body: {
          apiVersion: 'v1',
          kind: 'Pod',
          metadata: { name, labels: spec.labels ?? {}, ...(spec.annotations ? { annotations: spec.annotations } : {}) },
          spec: {
            nodeName: spec.nodeName ?? 'test-node',
            automountServiceAccountToken: false,
            containers: [{ name: 'engine', image: 'handoff/sim:test' }],
          },
        },
      })
      return res.body
    },
    async setPodStatus(namespace, name, status) {
      const now = new Date().toISOString().replace(/\.\d+Z$/, 'Z')
      const ready = status.ready ? 'True' : 'False'
      await call('PATCH', `${podPath(namespace, name)}/status`, {
        contentType: 'application/merge-patch+json',
        body: {
          status: {
            phase: 'Running',
            ...(status.podIP ? { podIP: status.podIP, podIPs: [{ ip: status.podIP }] } : {}),
            conditions: [
              { type: 'PodScheduled', status: 'True', lastTransitionTime: now },
              { type: 'ContainersReady', status: ready, lastTransitionTime: now },
              { type: 'Ready', status: ready, lastTransitionTime: now },
            ],
          },
        },
      })
    },
    async terminatePod(namespace, name) {
      await call('DELETE', podPath(namespace, name), { body: { kind: 'DeleteOptions', apiVersion: 'v1', gracePeriodSeconds: 30 } })
    },
    async deletePod(namespace, name) {
      await call('DELETE', podPath(namespace, name), { body: { kind: 'DeleteOptions', apiVersion: 'v1', gracePeriodSeconds: 0 } })
    },
    async etcdDelete(key) {
      // etcd's JSON gateway: keys are base64.
      const res = await request(`${etcdUrl}/v3/kv/deleterange`, {
        method: 'POST',
        body: JSON.stringify({ key: Buffer.from(key).toString('base64') }),
        signal: AbortSignal.timeout(5000),
      })
      const text = await res.body.text()
      if (res.statusCode !== 200) throw new Error(`etcd deleterange ${key}: HTTP ${res.statusCode}: ${text}`)
      if (!/"deleted":"?1/.test(text)) throw new Error(`etcd deleterange ${key}: nothing deleted (${text})`)
    },
    async kubectl(args, user = 'admin') {
      return run(join(kubeBinDir, 'kubectl'), [`--kubeconfig=${kubeconfig(user)}`, ...args], { timeout: 30_000 })
    },
    async helm(args) {
      // helm keeps caches and its repository list under $HOME: a directory of this test's own.
      const home = join(dir, 'helm-home')
      const env = { ...process.env, HOME: home, HELM_CACHE_HOME: join(home, 'cache'), HELM_CONFIG_HOME: join(home, 'config'), HELM_DATA_HOME: join(home, 'data') }
      return run(join(kubeBinDir, 'helm'), [`--kubeconfig=${kubeconfig('admin')}`, ...args], { timeout: 60_000, env })
    },
  }
}

/** Throwaway CA, a server certificate for 127.0.0.1/localhost, and the service-account key pair. */
async function makeCerts(dir: string): Promise<void> {
  const ssl = (args: string[]): Promise<unknown> => run('openssl', args, { cwd: dir })
  await ssl(['req', '-x509', '-newkey', 'rsa:2048', '-nodes', '-keyout', 'ca.key', '-out', 'ca.crt', '-days', '2', '-subj', '/CN=handoff-test-ca'])
  await ssl(['req', '-newkey', 'rsa:2048', '-nodes', '-keyout', 'server.key', '-out', 'server.csr', '-subj', '/CN=kube-apiserver'])
  writeFileSync(join(dir, 'server.ext'), 'subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:kubernetes.default.svc\nextendedKeyUsage=serverAuth\n')
  await ssl(['x509', '-req', '-in', 'server.csr', '-CA', 'ca.crt', '-CAkey', 'ca.key', '-CAcreateserial', '-out', 'server.crt', '-days', '2', '-extfile', 'server.ext'])
  await ssl(['genrsa', '-out', 'sa.key', '2048'])
  await ssl(['rsa', '-in', 'sa.key', '-pubout', '-out', 'sa.pub'])
}

interface Logged {
  child: ChildProcess
  /** Last part of what it wrote, for errors. */
  tail(): string
  exited: Promise<number | null>
}

function spawnLogged(cmd: string, args: string[], logFile: string): Logged {
  const child = spawn(cmd, args, { stdio: ['ignore', 'pipe', 'pipe'] })
  let buf = ''
  const keep = (d: Buffer): void => {
    buf = (buf + d.toString()).slice(-16384)
  }
  child.stdout?.on('data', keep)
  child.stderr?.on('data', keep)
  const exited = new Promise<number | null>((resolve) => {
    child.once('error', (err) => {
      buf += `\n${err.message}`
      resolve(-1)
    })
    child.once('exit', (code) => {
      writeFileSync(logFile, buf)
      resolve(code)
    })
  })
  return { child, tail: () => buf.slice(-4000), exited }
}

async function waitFor(what: string, proc: Logged, timeoutMs: number, ready: () => Promise<boolean>): Promise<void> {
  const deadline = performance.now() + timeoutMs
  let exitCode: number | null | undefined
  void proc.exited.then((c) => (exitCode = c))
  for (;;) {
    if (exitCode !== undefined) throw new Error(`${what} exited with ${exitCode}:\n${proc.tail()}`)
    if (await ready().catch(() => false)) return
    if (performance.now() > deadline) throw new Error(`${what} not ready after ${timeoutMs} ms:\n${proc.tail()}`)
    await sleep(100)
  }
}

async function kill(child: ChildProcess, graceMs: number): Promise<void> {
  if (child.exitCode !== null || child.signalCode !== null) return
  const exited = new Promise((resolve) => child.once('exit', resolve))
  child.kill('SIGTERM')
  const timer = setTimeout(() => child.kill('SIGKILL'), graceMs)
  await exited
  clearTimeout(timer)
}
