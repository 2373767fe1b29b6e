import { Writable } from 'node:stream'
import { pino } from 'pino'
import { seededRandom } from '../../common/random.js'
import { buildApp, type SimDeps } from '../../sim/src/app.js'
import { validateSimConfig } from '../../sim/src/config.js'

export const MODEL = 'handoff/sim-1'

export interface Built {
  app: ReturnType<typeof buildApp>
  logs: Record<string, unknown>[]
}

/** A simulator app for `inject` tests, logging into an array; closed at teardown. */
export function build(t: { teardown(fn: () => unknown): void }, config: Record<string, unknown> = {}, deps: Partial<SimDeps> = {}): Built {
  const logs: Record<string, unknown>[] = []
  const sink = new Writable({
    write(chunk: Buffer, _enc, cb) {
      for (const line of chunk.toString().split('\n')) if (line) logs.push(JSON.parse(line) as Record<string, unknown>)
      cb()
    },
  })
  const app = buildApp({ config: validateSimConfig(config), logger: pino({ level: 'info' }, sink), random: seededRandom(42), ...deps })
  t.teardown(() => app.close())
  return { app, logs }
}

/** The parsed frames of an SSE body and whether it ended with `data: [DONE]`. */
export function parseSse(body: string): { frames: Record<string, unknown>[]; done: boolean } {
  const events = body.split('\n\n').filter(Boolean)
  const done = events.at(-1) === 'data: [DONE]'
  const frames = events.filter((e) => e !== 'data: [DONE]').map((e) => JSON.parse(e.replace(/^data: /, '')) as Record<string, unknown>)
  return { frames, done }
}

/** Polls `check` every 20 ms until it holds (a pass) or `ms` runs out (a failure). */
export async function eventually(t: { pass(msg: string): void; fail(msg: string): void }, what: string, check: () => Promise<boolean>, ms = 5000): Promise<void> {
  const until = performance.now() + ms
  while (performance.now() < until) {
    if (await check()) return void t.pass(what)
    await new Promise((r) => setTimeout(r, 20))
  }
  t.fail(`${what}: not within ${ms} ms`)
}
