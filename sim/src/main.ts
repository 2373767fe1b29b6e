import type { AddressInfo } from 'node:net'
import closeWithGrace from 'close-with-grace'
import { announceReady } from '../../common/ready.js'
import { seededRandom, systemRandom, type Random } from '../../common/random.js'
import { mapSharedMemory, type SharedMemory } from '../../native/shm.js'
import type { SimConfig } from '../../schemas/sim-config.js'
import { AgentLink } from './agent-link.js'
import { buildApp } from './app.js'
import { parseSimArgs, usage, validateSimConfig } from './config.js'
import { oracleMain } from './oracle-cli.js'
import { hostPort } from '../../common/host-port.js'

/**
 * `--kv agent`: the KV region lives in a POSIX shared-memory object that this process
 * creates and the agent maps and registers with NIXL, so remote READs land in the engine's
 * own blocks. The default name carries the engine id (fixed here, so the name can) and pid.
 */
function agentMemory(config: Readonly<SimConfig>, random: Random): { config: Readonly<SimConfig>; shm: SharedMemory } {
  const engineId = config.engineId ?? `sim-${random.hex(8)}`
  const withId = config.engineId === undefined ? validateSimConfig({ ...structuredClone(config), engineId }) : config
  const name = config.shmName ?? `/handoff-kv-${engineId}-${process.pid}`
  const shm = mapSharedMemory(name, config.numGpuBlocksOverride * config.blockSize * config.bytesPerToken, { create: true })
  return { config: withId, shm }
}

/** This engine's URL as the router knows it: the listen address, unless that is a wildcard. */
function engineUrl(host: string, port: number, listening: string): string {
  if (host === '0.0.0.0' || host === '::' || host === '') return listening
  return `http://${hostPort(host, port)}`
}

/** `handoff sim [options]` and `handoff sim oracle ...`. */
export async function main(argv: string[]): Promise<void> {
  if (argv[0] === 'oracle') return oracleMain(argv.slice(1))
  let config
  try {
    config = parseSimArgs(argv)
  } catch (err) {
    const e = err as { code?: string; message: string }
    process.stderr.write(`handoff sim: ${e.code ?? 'error'}: ${e.message}\n\nRun \`handoff sim --help\` for the options.\n`)
    process.exitCode = 2
    return
  }
  if (config === 'help') {
    process.stdout.write(usage())
    return
  }
  const random = config.seed === undefined ? systemRandom : seededRandom(config.seed)
  let app
  let shm: SharedMemory | undefined
  try {
    if (config.kv === 'agent') ({ config, shm } = agentMemory(config, random))
    app = buildApp({ config, random, ...(shm ? { kvMemory: shm.buffer, shmName: shm.name } : {}) })
  } catch (err) {
    try {
      shm?.unlink()
    } catch {
      // Reported below: the error that stopped the start matters more.
    }
    const e = err as { code?: string; message: string }
    process.stderr.write(`handoff sim: ${e.code ?? 'error'}: ${e.message}\n`)
    process.exitCode = 2
    return
  }
  // The name goes; the mapping stays valid until exit (the agent keeps its own).
  if (shm) app.addHook('onClose', async () => void shm.unlink())
  const url = await app.listen({ host: config.host, port: config.port })
  // The agent tells the router which instance it serves by this URL (DESIGN "Transfer agent"):
  // attach again with it now that the port is known (health stays 503 until the agent has it).
  const kv = app.simKv
  const urlGiven = kv instanceof AgentLink ? kv.setEngineUrl(engineUrl(config.host, (app.server.address() as AddressInfo).port, url)) : undefined
  // Bounded: stalled requests are cut by the shutdown signal in onClose, streams finish.
  closeWithGrace({ delay: 10_000 }, async ({ signal, err }) => {
    if (err) app.log.error({ err }, 'closing after an error')
    else app.log.info({ signal }, 'closing')
    await app.close()
  })
  // Ready means ready to serve: in `--kv agent` mode once attached to the agent.
  try {
    await app.simKv?.whenReady?.()
    await urlGiven
  } catch {
    return
  }
  announceReady('sim', url)
}
