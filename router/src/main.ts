import { parseArgs } from 'node:util'
import closeWithGrace from 'close-with-grace'
import { announceReady } from '../../common/ready.js'
import { loadConfig } from './config.js'

const HELP = `usage: handoff router [--config FILE] [--host HOST] [--port PORT] [--log-level LEVEL]
                      [--store memory|redis://HOST:PORT] [--lease-seconds S]
                      [--admin-port PORT] [--agent-port PORT]

Runs the router: the OpenAI-compatible front door for a P/D cluster.
The config file is JSON (schema: schemas/json/RouterConfig.json); env overrides:
HANDOFF_HOST, HANDOFF_PORT, HANDOFF_LOG_LEVEL, HANDOFF_API_KEYS, HANDOFF_ADMIN_TOKEN,
HANDOFF_DRAIN_TOKEN, HANDOFF_AGENT_TOKEN, HANDOFF_UPSTREAM_API_KEY, HANDOFF_INSTANCES (JSON array of instances), HANDOFF_STORE,
HANDOFF_LEASE_SECONDS.
--lease-seconds S  the engines' KV lease (leases.leaseSeconds; vLLM's kv_lease_duration):
                   it must equal the engines' own, or the router hands D freed blocks
--store redis://…  several routers on one Redis share events, topology and leases
                   (docs/several-routers.md); memory (default) is this process alone.
--admin-port PORT  /admin, /fault_tolerance, /topology and /leases on this port only
--agent-port PORT  /v1/agents… on this port only (docs/security.md)
`

/** `handoff router`: env → config → build → listen → close-with-grace. */
export async function main(argv: string[]): Promise<void> {
  const { values } = parseArgs({
    args: argv,
    options: {
      config: { type: 'string', short: 'c' },
      host: { type: 'string' },
      port: { type: 'string' },
      'admin-port': { type: 'string' },
      'agent-port': { type: 'string' },
      'log-level': { type: 'string' },
      store: { type: 'string' },
      'lease-seconds': { type: 'string' },
      help: { type: 'boolean', short: 'h' },
    },
  })
  if (values.help) {
    process.stdout.write(HELP)
    return
  }
  const warnings: string[] = []
  const config = loadConfig({
    ...(values.config ? { file: values.config } : {}),
    env: process.env,
    onWarning: (message) => warnings.push(message),
    overrides: {
      ...(values.host ? { host: values.host } : {}),
      ...(values.port !== undefined ? { port: Number(values.port) } : {}),
      ...(values['admin-port'] !== undefined ? { adminPort: Number(values['admin-port']) } : {}),
      ...(values['agent-port'] !== undefined ? { agentPort: Number(values['agent-port']) } : {}),
      ...(values['log-level'] ? { logLevel: values['log-level'] as never } : {}),
      ...(values.store ? { store: values.store } : {}),
      ...(values['lease-seconds'] !== undefined ? { leaseSeconds: Number(values['lease-seconds']) } : {}),
    },
  })
  // Loaded after --help and the config check: `--help` and a bad config answer at once.
  const { buildApp } = await import('./app.js')
  const app = await buildApp({ config })
  for (const message of warnings) app.log.warn(message)
  // In-flight streams get shutdownGraceMs to finish; then the process exits regardless.
  closeWithGrace({ delay: config.shutdownGraceMs }, async ({ signal, err }) => {
    if (err) app.log.error({ err }, 'closing after an error')
    else app.log.info({ signal }, 'closing: no new requests, waiting for in-flight ones')
    await app.close()
  })
  const address = await app.listen({ host: config.host, port: config.port })
  const planes = await app.listenPlanes()
  if (planes.admin) app.log.info({ url: planes.admin }, 'operations plane listening')
  if (planes.agents) app.log.info({ url: planes.agents }, 'agent plane listening')
  announceReady('router', address)
}
