import type { InstanceRole } from '../../../schemas/router-config.js'

/*
 * What the topology shows the rest of the router: immutable views of its instances. A leaf
 * module, so selection (selection.ts, candidates.ts) reads views without importing the
 * registry that builds them.
 */

/**
 * Where an instance came from: the config file, an autoscaler call, its agent's registration,
 * or Kubernetes discovery (a Ready pod matching a role's selector).
 */
export type InstanceSource = 'config' | 'admin' | 'agent' | 'kubernetes'

/**
 * The label naming an instance's NIXL side channel, host:port (what its prefill answers call
 * remote_host:remote_port, and what vLLM's logs name a peer by). Discovery sets it from the
 * pod's annotation; a static instance may carry it in its config. `peer_gone` for the
 * instance's engine lists it among the addresses, and an address given to
 * POST /fault_tolerance/event resolves to the instance through it.
 */
export const SIDE_CHANNEL_LABEL = 'handoff.dev/side-channel'

/** An immutable view of one instance, as selection sees it. */
export interface InstanceView {
  readonly id: string
  readonly role: InstanceRole
  readonly source: InstanceSource
  readonly url: string
  readonly labels: Readonly<Record<string, string>>
  /**
   * The live engine_ids its URL answers with (engine-ids.ts: data-parallel ranks, several
   * pods behind one Service), least recently seen first when the set last changed.
   */
  readonly engineIds: readonly string[]
  /** The engine_id added to the set last; undefined before the first prefill answer. */
  readonly engineId: string | undefined
  /** Whether the URL proved to front several engines of one rank: no engine_id replaces another there. */
  readonly sharedRanks: boolean
  /** Eligible for new work: probed up (or not yet probed), not ejected, not draining. */
  readonly healthy: boolean
  readonly draining: boolean
  readonly inflight: number
  /** Requests it may have in flight: admission's limit, fixed or following the engine. */
  readonly limit: number
  /** Models the instance serves; undefined until its /v1/models was read. */
  readonly models: ReadonlySet<string> | undefined
}

export interface TopologySnapshot {
  readonly instances: readonly InstanceView[]
  /** Union of every instance's models. */
  readonly models: ReadonlySet<string>
}
