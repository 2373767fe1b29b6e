import t from 'tap'
import { spawnService } from '../../common/spawn.js'

// A service that refuses its arguments exits at once with its code, also when started with an
// IPC channel (as every test and `handoff up` start them): the open channel used to keep the
// refused process alive, so its start-up failed only at the ready timeout.
for (const args of [
  ['agent', '--peer-secret', 'short'],
  ['router', '--store', 'nonsense'],
  ['sim', '--shm-name', 'no-slash'],
]) {
  t.test(`handoff ${args.join(' ')}: exits with its code, not at the ready timeout`, async (t) => {
    const err = await spawnService({ args, readyTimeoutMs: 60_000 }).then(
      () => undefined,
      (e: Error) => e,
    )
    t.ok(err, 'start-up fails')
    t.match(err?.message, /exited \((1|2)\) before ready/, 'with the exit code')
  })
}
