import type { Registry, RegistryContentType } from 'prom-client'
import type { Clock } from '../../../common/clock.js'
import type { Random } from '../../../common/random.js'
import type { DiscoveryConfig } from '../../../schemas/router-config.js'
import type { Discovery, DiscoveryLogger, DiscoveryTarget } from './kubernetes.js'

export type { Discovery, DiscoveryLogger, DiscoveryTarget } from './kubernetes.js'

/**
 * Starts the configured discovery (only `kubernetes` so far). Resolves once the engines there
 * at start-up are in the topology; rejects with RTR_ERR_CONFIG when discovery cannot work
 * (credentials, RBAC, an unreachable API server). The Kubernetes client is loaded only here,
 * when discovery is configured: it is most of what a router would otherwise load for nothing.
 */
export async function startDiscovery(config: DiscoveryConfig, deps: { target: DiscoveryTarget; logger: DiscoveryLogger; clock: Clock; random: Random; metrics?: Registry<RegistryContentType> }): Promise<Discovery> {
  switch (config.kind) {
    case 'kubernetes': {
      const { startKubernetesDiscovery } = await import('./kubernetes.js')
      return startKubernetesDiscovery({ config, ...deps })
    }
  }
}
