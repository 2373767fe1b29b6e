import { KubeConfig, ListWatch, type V1Pod, type V1PodList } from '@kubernetes/client-node'
import { Counter, type Registry, type RegistryContentType } from 'prom-client'
import type { Clock, ClockTimer } from '../../../common/clock.js'
import type { Random } from '../../../common/random.js'
import type { DiscoveryConfig, InstanceConfig, InstanceRole } from '../../../schemas/router-config.js'
import { RTR_ERR_CONFIG } from '../errors.js'
import { hostPort } from '../../../common/host-port.js'
import { SIDE_CHANNEL_LABEL } from '../topology/views.js'
import { KubeHttp, WatchIdleError } from './kube-http.js'

/** Where a pod publishes its engine's NIXL side-channel port (VLLM_NIXL_SIDE_CHANNEL_PORT); the chart's engine pods do. */
export const SIDE_CHANNEL_PORT_ANNOTATION = 'handoff.dev/side-channel-port'

/**
 * Where a pod's engine publishes its KV events (vLLM's --kv-events-config endpoint, bound as
 * `tcp://*:PORT`) and its replay socket: the router follows them for prefix-aware routing
 * (docs/routing.md). The chart's vLLM engine pods set them.
 */
export const KV_EVENTS_PORT_ANNOTATION = 'handoff.dev/kv-events-port'
export const KV_EVENTS_REPLAY_PORT_ANNOTATION = 'handoff.dev/kv-events-replay-port'
/** The topic the engine publishes on (vLLM's `topic`; default empty). */
export const KV_EVENTS_TOPIC_ANNOTATION = 'handoff.dev/kv-events-topic'

/**
 * What discovery needs from the topology: the registry and the drainer satisfy it (app.ts
 * wires them); tests may pass their own. Every call may be async, and discovery awaits each
 * before it looks at the next change, so a pod's instance never races its own retirement.
 */
export interface DiscoveryTarget {
  has(id: string): boolean
  /**
   * Whether the instance `id` came from discovery, here or on another router sharing the
   * store (optional: default never). Such an instance is adopted rather than ignored, so
   * every router drains the pods it sees stop serving, whoever added them.
   */
  discovered?(id: string): boolean
  /** A discovered instance joins (source `kubernetes`), eligible at once. */
  add(cfg: InstanceConfig): unknown
  /**
   * No new work from now on; removed once nothing holds it, with peer_gone for its engine
   * when `peerGone` (the pod is going away), without it when the pod is only not Ready.
   */
  drain(id: string, opts: { peerGone: boolean }): unknown
  /** Retire now: peer_gone for its engine_ids, then removed. */
  remove(id: string, reason: string): unknown
  /** `listener(id)` after any instance left the topology, whoever removed it; returns the unsubscribe. */
  onRemoved(listener: (id: string) => void): () => void
}

export interface DiscoveryLogger {
  info(obj: object, msg: string): void
  warn(obj: object, msg: string): void
  error(obj: object, msg: string): void
}

export interface Discovery {
  /** Stops every watch; instances already found stay in the topology. */
  stop(): Promise<void>
  /** Counters for tests and logs (and the metrics): see DiscoveryStats. */
  stats(): DiscoveryStats
  /** Resolves once every change seen so far has been applied to the target. */
  settled(): Promise<void>
}

export interface DiscoveryStats {
  /** Pod lists done: the first, each after 410 Gone, each periodic re-list. */
  lists: number
  /** Periodic re-lists started (`relistIntervalMs`). */
  relists: number
  /** Watches (and lists) that carried nothing for `idleTimeoutMs`, dropped as dead. */
  idleWatches: number
  /** Watch and list failures of any kind, idle ones included; each is tried again after a backoff. */
  watchErrors: number
}

export interface StartKubernetesDiscoveryOptions {
  config: DiscoveryConfig
  target: DiscoveryTarget
  logger: DiscoveryLogger
  clock: Clock
  /** Jitter of the watch timeouts and the re-list interval. */
  random: Random
  /** The router's metrics registry; none: no metrics. */
  metrics?: Registry<RegistryContentType>
  /** A KubeConfig built by the caller; default: `config.kubeconfig`, else the pod's service account. */
  kubeConfig?: KubeConfig
}

const ROLES: readonly InstanceRole[] = ['prefill', 'decode', 'both']
// After a watch that lived this long, a failure starts the backoff over.
const STABLE_MS = 10_000

/** The instance id of a pod: namespace and pod names are DNS names, so `:` cannot be in them. */
export function podInstanceId(namespace: string, pod: string): string {
  return `k8s:${namespace}:${pod}`
}

/** Ready (the kubelet's Ready condition) with an IP, and not on its way out. */
function serving(pod: V1Pod): string | undefined {
  if (pod.metadata?.deletionTimestamp) return undefined
  const ready = pod.status?.conditions?.some((c) => c.type === 'Ready' && c.status === 'True')
  return ready ? pod.status?.podIP || undefined : undefined
}

/**
 * The instance's labels: the pod's, and SIDE_CHANNEL_LABEL (podIP:port) when the pod publishes
 * its NIXL side-channel port in the annotation SIDE_CHANNEL_PORT_ANNOTATION.
 */
function podLabels(pod: V1Pod, ip: string): Record<string, string> {
  const labels = { ...(pod.metadata?.labels ?? {}) }
  const port = pod.metadata?.annotations?.[SIDE_CHANNEL_PORT_ANNOTATION]
  if (port !== undefined && /^[0-9]{1,5}$/.test(port) && Number(port) >= 1 && Number(port) <= 65535) labels[SIDE_CHANNEL_LABEL] = hostPort(ip, Number(port))
  return labels
}

const portAnnotation = (pod: V1Pod, key: string): number | undefined => {
  const v = pod.metadata?.annotations?.[key]
  return v !== undefined && /^[0-9]{1,5}$/.test(v) && Number(v) >= 1 && Number(v) <= 65535 ? Number(v) : undefined
}

/** The instance's kvEvents from the pod's KV_EVENTS_* annotations (none: it publishes none, or they are malformed). */
function podKvEvents(pod: V1Pod, ip: string): InstanceConfig['kvEvents'] {
  const port = portAnnotation(pod, KV_EVENTS_PORT_ANNOTATION)
  if (port === undefined) return undefined
  const replay = portAnnotation(pod, KV_EVENTS_REPLAY_PORT_ANNOTATION)
  const topic = pod.metadata?.annotations?.[KV_EVENTS_TOPIC_ANNOTATION]
  return {
    endpoint: `tcp://${hostPort(ip, port)}`,
    ...(replay !== undefined ? { replayEndpoint: `tcp://${hostPort(ip, replay)}` } : {}),
    ...(topic !== undefined ? { topic } : {}),
  }
}

/** One incarnation of a pod, as it stands in the topology. */
interface Tracked {
  id: string
  uid: string
  role: InstanceRole
  url: string
  draining: boolean
  /** The drain was told the pod is going away (terminating or deleted), not just not Ready. */
  going: boolean
}

/**
 * Kubernetes discovery (issue 11): one informer per configured role lists, then watches, the
 * namespace's pods matching that role's selector. The informer re-lists when the API server
 * answers 410 Gone (the resourceVersion it held fell out of the watch window), and diffs the
 * new list against its cache, so a pod deleted while nobody watched still comes out as a
 * delete. On any other failure (API server restarting, network) it stops; discovery starts it
 * again after a backoff, from the last resourceVersion. Meanwhile the topology keeps what it
 * had: an unreachable API server says nothing about the engines. A watch that went silent
 * (its connection dead without a reset) fails after `idleTimeoutMs` like any other (kube-http.ts),
 * and every `relistIntervalMs` the informer lists again and diffs, so a change a watch missed
 * is found within that interval.
 *
 * Each change is reconciled from the informers' caches, level-triggered: a pod Ready with an
 * IP is an instance; one that stops being Ready, starts terminating or is deleted leaves
 * through the drain path; one replaced under the same name (new uid or IP) is retired at once
 * (its old engine is gone: peer_gone) before the new one joins. Out of routing is not gone:
 * a pod that is only not Ready leaves without peer_gone, since it may be Ready again soon with
 * the same engine, and agents would refuse that engine's blocks for their tombstone's life;
 * terminating or deleted, its engine is going away, so the drain ends with peer_gone.
 *
 * A permission error on the first list or watch (RBAC) fails start-up with RTR_ERR_CONFIG:
 * a router that silently saw no pods would look healthy and route nothing.
 */
export async function startKubernetesDiscovery(opts: StartKubernetesDiscoveryOptions): Promise<Discovery> {
  const { config, target, logger, clock } = opts
  const namespace = config.namespace
  const kc = opts.kubeConfig ?? loadKubeConfig(config)
  const tracked = new Map<string, Tracked>()
  const informers = new Map<InstanceRole, ListWatch<V1Pod>>()
  const timers = new Set<ClockTimer>()
  const counters: DiscoveryStats = { lists: 0, relists: 0, idleWatches: 0, watchErrors: 0 }
  const metric = opts.metrics ? discoveryMetrics(opts.metrics) : undefined
  const counter = (name: keyof DiscoveryStats): void => {
    counters[name]++
    metric?.[name].inc()
  }
  let stopped = false

  // One queue: each pod name is reconciled at most once per pending change.
  const dirty = new Set<string>()
  let chain: Promise<void> = Promise.resolve()
  const schedule = (name: string): void => {
    if (dirty.has(name)) return
    dirty.add(name)
    chain = chain.then(async () => {
      dirty.delete(name)
      if (stopped) return
      try {
        await reconcile(name)
      } catch (err) {
        logger.error({ err, pod: name }, 'kubernetes discovery: could not apply a pod change')
      }
    })
  }

  const portOf = (role: InstanceRole): number => {
    const r = config[role]
    if (!r) throw new Error(`no discovery config for role ${role}`)
    return r.port
  }

  async function reconcile(name: string): Promise<void> {
    // The pod as the caches have it now: the first role whose selector matches it.
    let pod: V1Pod | undefined
    let role: InstanceRole | undefined
    for (const r of ROLES) {
      const p = informers.get(r)?.get(name, namespace)
      if (!p) continue
      if (pod) {
        logger.warn({ pod: name, roles: [role, r] }, 'kubernetes discovery: pod matches more than one role selector; the first wins')
        break
      }
      pod = p
      role = r
    }
    const ip = pod && serving(pod)
    const want =
      pod && role && ip
        ? { uid: pod.metadata?.uid ?? '', role, url: `http://${hostPort(ip, portOf(role))}`, labels: podLabels(pod, ip), kvEvents: podKvEvents(pod, ip) }
        : undefined

    const t = tracked.get(name)
    if (t) {
      // A new uid, or a new IP, under the same name: another incarnation (a StatefulSet pod
      // recreated, a pod deleted and made again). A role change of the same pod is not.
      const replaced = pod !== undefined && ((pod.metadata?.uid ?? '') !== t.uid || (want !== undefined && want.url !== t.url))
      if (replaced) {
        // The old incarnation's engine is gone with it: retire it now (peer_gone).
        tracked.delete(name)
        logger.info({ instance: t.id, uid: t.uid, url: t.url }, 'kubernetes discovery: pod replaced; retiring the old incarnation')
        if (target.has(t.id)) await target.remove(t.id, `pod ${namespace}/${name} replaced`)
      } else if (want && want.role === t.role) {
        return // serving as before (a draining one joins again once it has left)
      } else {
        const going = !pod || Boolean(pod.metadata?.deletionTimestamp)
        if (!t.draining || (going && !t.going)) {
          t.draining = true
          t.going = going
          const why = !pod ? 'deleted' : pod.metadata?.deletionTimestamp ? 'terminating' : 'not ready'
          logger.info({ instance: t.id, reason: why }, going ? 'kubernetes discovery: pod going away; draining' : 'kubernetes discovery: pod not ready; out of routing until it is')
          if (target.has(t.id)) await target.drain(t.id, { peerGone: going })
        }
        return
      }
    }
    if (!want) return
    const id = podInstanceId(namespace, name)
    if (target.has(id)) {
      if (target.discovered?.(id)) {
        // Another router sharing the store added it: follow it from here too.
        tracked.set(name, { id, uid: want.uid, role: want.role, url: want.url, draining: false, going: false })
        return
      }
      logger.warn({ instance: id }, 'kubernetes discovery: an instance with this id is already in the topology (static config?); pod ignored')
      return
    }
    tracked.set(name, { id, uid: want.uid, role: want.role, url: want.url, draining: false, going: false })
    logger.info({ instance: id, role: want.role, url: want.url, uid: want.uid }, 'kubernetes discovery: pod ready; instance added')
    await target.add({ id, role: want.role, url: want.url, labels: want.labels, ...(want.kvEvents ? { kvEvents: want.kvEvents } : {}) })
  }

  // An instance of ours left (drained, or deleted by hand): forget it, and look at its pod
  // again (Ready once more after a flap: it joins anew).
  const unsubscribe = target.onRemoved((id) => {
    for (const [name, t] of tracked) {
      // The same id may already belong to the next incarnation.
      if (t.id !== id || target.has(id)) continue
      tracked.delete(name)
      schedule(name)
    }
  })

  const stopAll = async (): Promise<void> => {
    stopped = true
    unsubscribe()
    for (const timer of timers) clock.clearTimeout(timer)
    timers.clear()
    await Promise.all([...informers.values()].map((i) => i.stop()))
  }

  try {
    for (const role of ROLES) {
      const rc = config[role]
      if (!rc) continue
      const path = `/api/v1/namespaces/${namespace}/pods`
      const http = new KubeHttp(kc, { timeoutSeconds: config.watchTimeoutSeconds, idleMs: config.idleTimeoutMs, random: opts.random })
      const list = async (): Promise<V1PodList> => {
        const list = await http.list<V1PodList>(path, { labelSelector: rc.selector })
        counter('lists')
        logger.info({ role, selector: rc.selector, pods: list.items.length, resourceVersion: list.metadata?.resourceVersion }, 'kubernetes discovery: listed pods')
        return list
      }
      const informer = new ListWatch<V1Pod>(path, http, list, false, rc.selector)
      const onPod = (pod: V1Pod): void => {
        const name = pod.metadata?.name
        if (name) schedule(name)
      }
      informer.on('add', onPod)
      informer.on('update', onPod)
      informer.on('delete', onPod)
      informers.set(role, informer)

      // start() resolves after the first list and the watch request; errors come as events.
      let first: unknown
      const onFirst = (err: unknown): void => {
        first ??= err
      }
      informer.on('error', onFirst)
      await informer.start()
      informer.off('error', onFirst)
      if (first !== undefined) throw startupError(first, namespace, role, rc.selector)

      let backoff = config.backoffMs
      let startedAt = clock.monotonic()
      informer.on('error', (err: unknown) => {
        if (stopped) return
        counter('watchErrors')
        if (clock.monotonic() - startedAt > STABLE_MS) backoff = config.backoffMs
        if (err instanceof WatchIdleError) {
          counter('idleWatches')
          logger.warn({ role, err: err.message, retryInMs: backoff }, 'kubernetes discovery: pod watch silent: presumed dead, watching again')
        } else logger.warn({ role, err: describe(err), retryInMs: backoff }, 'kubernetes discovery: pod watch failed; the topology stays as it is until it is back')
        const timer = clock.setTimeout(() => {
          timers.delete(timer)
          if (stopped) return
          startedAt = clock.monotonic()
          informer.start().catch((e: unknown) => logger.error({ role, err: describe(e) }, 'kubernetes discovery: restarting the pod watch failed'))
        }, backoff)
        timer.unref?.()
        timers.add(timer)
        backoff = Math.min(backoff * 2, config.maxBackoffMs)
      })

      // A watch can miss a change and never know (a bug anywhere between etcd and here):
      // list again now and then, and diff (a missed delete comes out as a delete).
      if (config.relistIntervalMs > 0) {
        const relist = (): void => {
          const timer = clock.setTimeout(() => {
            timers.delete(timer)
            if (stopped) return
            if (http.expire()) {
              counter('relists')
              logger.info({ role }, 'kubernetes discovery: periodic re-list')
            }
            relist()
          }, config.relistIntervalMs * (0.9 + 0.2 * opts.random.next()))
          timer.unref?.()
          timers.add(timer)
        }
        relist()
      }
    }
  } catch (err) {
    await stopAll()
    throw err
  }
  // Serve with the pods that were there at start-up already in the topology.
  await settled()
  return { stop: stopAll, stats: () => ({ ...counters }), settled }

  async function settled(): Promise<void> {
    // A reconcile may schedule another (a removal it caused): wait until the queue stays empty.
    let seen: Promise<void>
    do {
      seen = chain
      await seen
    } while (seen !== chain)
  }
}

function discoveryMetrics(registry: Registry<RegistryContentType>): Record<keyof DiscoveryStats, Counter> {
  const make = (name: string, help: string): Counter => new Counter({ name: `handoff_router_discovery_${name}`, help, registers: [registry] })
  return {
    lists: make('pod_lists_total', 'Pod lists done: the first, each after 410 Gone, each periodic re-list.'),
    relists: make('periodic_relists_total', 'Periodic re-lists of the pods (discovery.relistIntervalMs).'),
    idleWatches: make('idle_watches_total', 'Pod watches or lists that carried nothing for discovery.idleTimeoutMs: dropped as dead and started again.'),
    watchErrors: make('watch_errors_total', 'Pod watch and list failures of any kind, idle ones included; each is tried again after a backoff.'),
  }
}

function loadKubeConfig(config: DiscoveryConfig): KubeConfig {
  const kc = new KubeConfig()
  try {
    if (config.kubeconfig) kc.loadFromFile(config.kubeconfig)
    else kc.loadFromCluster()
  } catch (err) {
    throw new RTR_ERR_CONFIG(`discovery: cannot load ${config.kubeconfig ? `kubeconfig ${config.kubeconfig}` : 'the in-cluster service account'}: ${describe(err)}`, { cause: err })
  }
  if (!kc.getCurrentCluster()) throw new RTR_ERR_CONFIG(`discovery: ${config.kubeconfig ?? 'the in-cluster config'} names no current cluster`)
  return kc
}

/** The HTTP status of a client-node failure: ApiException's `code`, the watch's `statusCode`. */
function statusOf(err: unknown): number | undefined {
  if (typeof err !== 'object' || err === null) return undefined
  const e = err as { code?: unknown; statusCode?: unknown }
  if (typeof e.code === 'number') return e.code
  if (typeof e.statusCode === 'number') return e.statusCode
  return undefined
}

/** The API server's own words (a Status object's message) where there are some. */
function describe(err: unknown): string {
  const body = (err as { body?: unknown } | null)?.body
  if (typeof body === 'string') {
    try {
      const status = JSON.parse(body) as { message?: unknown }
      if (typeof status.message === 'string') return status.message
    } catch {
      // not JSON: fall through to the error's message
    }
  }
  if (typeof body === 'object' && body !== null && typeof (body as { message?: unknown }).message === 'string') return (body as { message: string }).message
  return err instanceof Error ? err.message : String(err)
}

function startupError(err: unknown, namespace: string, role: InstanceRole, selector: string): Error {
  const status = statusOf(err)
  const what = `listing and watching pods in namespace ${namespace} (${role}: ${selector})`
  if (status === 401) {
    return new RTR_ERR_CONFIG(`discovery: the Kubernetes API server rejected the router's credentials (401) ${what}: ${describe(err)}`, { cause: err })
  }
  if (status === 403) {
    return new RTR_ERR_CONFIG(
      `discovery: RBAC denies ${what} (403): ${describe(err)}; grant the router's service account get, list and watch on pods in that namespace`,
      { cause: err },
    )
  }
  return new RTR_ERR_CONFIG(`discovery: ${what} failed${status ? ` (HTTP ${status})` : ''}: ${describe(err)}`, { cause: err })
}
