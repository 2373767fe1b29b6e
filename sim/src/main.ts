import closeWithGrace from 'close-with-grace'
import { announceReady } from '../../common/ready.js'
import { seededRandom, systemRandom } from '../../common/random.js'
import { buildApp } from './app.js'
import { parseSimArgs, usage } from './config.js'
import { oracleMain } from './oracle-cli.js'

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
  let app
  try {
    app = buildApp({ config, random: config.seed === undefined ? systemRandom : seededRandom(config.seed) })
  } catch (err) {
    const e = err as { code?: string; message: string }
    process.stderr.write(`handoff sim: ${e.code ?? 'error'}: ${e.message}\n`)
    process.exitCode = 2
    return
  }
  const url = await app.listen({ host: config.host, port: config.port })
  announceReady('sim', url)
  // Bounded: stalled requests are cut by the shutdown signal in onClose, streams finish.
  closeWithGrace({ delay: 10_000 }, async ({ signal, err }) => {
    if (err) app.log.error({ err }, 'closing after an error')
    else app.log.info({ signal }, 'closing')
    await app.close()
  })
}
