import closeWithGrace from 'close-with-grace'
import { pino } from 'pino'
import { systemClock } from '../../common/clock.js'
import { loggerOptions } from '../../common/logger.js'
import { systemRandom } from '../../common/random.js'
import { announceReady } from '../../common/ready.js'
import { loadNixl } from '../../native/index.js'
import { agentPeerKey, TransferAgent } from './agent.js'
import { buildAgentApp } from './app.js'
import { agentUsage, parseAgentArgs } from './config.js'
import { xfaError } from './errors.js'
import { createAgentMetrics } from './metrics.js'

/** `handoff agent [options]`: one transfer agent, serving until SIGINT/SIGTERM. */
export async function main(argv: string[]): Promise<void> {
  let config
  try {
    config = parseAgentArgs(argv)
  } catch (err) {
    const e = err as { code?: string; message: string }
    process.stderr.write(`handoff agent: ${e.code ?? 'error'}: ${e.message}\n\nRun \`handoff agent --help\` for the options.\n`)
    process.exitCode = 2
    return
  }
  if (config === 'help') {
    process.stdout.write(agentUsage())
    return
  }
  const log = pino(loggerOptions({ name: 'agent', level: config.logLevel }))
  try {
    const info = await loadNixl(config.nixlLibDir ? { libDir: config.nixlLibDir } : {})
    log.info({ nixl: info.path, version: info.version, source: info.source }, 'NIXL loaded')
  } catch (cause) {
    const e = xfaError('XFA_ERR_NIXL_UNAVAILABLE', (cause as Error).message, { cause })
    process.stderr.write(`handoff agent: ${e.code}: ${e.message}\n`)
    process.exitCode = 3
    return
  }
  const metrics = createAgentMetrics()
  let address = { host: config.advertiseHost ?? config.host, port: config.port }
  const agent = new TransferAgent({ config, clock: systemClock, random: systemRandom, log, metrics, peerAddress: () => address })
  const key = agentPeerKey(config)
  const app = buildAgentApp({ agent, metrics, logger: log, ...(config.agentToken ? { agentToken: config.agentToken } : {}), ...(key ? { peerKey: key } : {}) })
  const url = await app.listen({ host: config.host, port: config.port })
  const port = (app.server.address() as { port: number }).port
  address = { host: config.advertiseHost ?? config.host, port }
  log.info({ url, agentId: agent.agentId, leaseSeconds: config.leaseSeconds }, 'agent serving')
  announceReady('agent', url)
  closeWithGrace({ delay: 10_000 }, async ({ signal, err }) => {
    if (err) log.error({ err }, 'closing after an error')
    else log.info({ signal }, 'closing')
    await app.close()
  })
}
