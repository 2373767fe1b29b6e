// kill -9 of the target in the middle of a series of READs: the reader must get a coded error
// within a bounded time (the addon's own deadline backs up UCX's peer-failure detection), and
// read again after re-handshaking with a restarted target of the same name.
import t from 'tap'
import { addressOf, type NixlAgent } from '../../native/index.js'
import { patternBuffer } from './fixtures/pattern.js'
import { describeNixl, needNixl, probeNixl, readerAgent, startTarget, type Target } from './helpers.js'

const probe = await probeNixl()
const skip = needNixl(t, probe)

const SIZE = 8 << 20
const READ_TIMEOUT_MS = 5000
// Detection bound asserted by the test: the deadline plus slack for a loaded 2-core machine.
const DETECT_BOUND_MS = READ_TIMEOUT_MS + 5000

t.test('kill -9 mid-series, then re-handshake', { skip }, async (t) => {
  if (!probe.ok) return
  t.comment(describeNixl(probe.info))
  const reader: NixlAgent = await readerAgent(`reader-kill-${process.pid}`)
  t.teardown(() => reader.close())
  const local = Buffer.alloc(SIZE)
  await reader.registerMemory(local)
  const name = `target-kill-${process.pid}`

  const targets: Target[] = []
  t.teardown(async () => {
    for (const x of targets) await x.kill()
  })

  const boot = async (seed: number): Promise<{ peer: string; addr: bigint }> => {
    const target = await startTarget(name, probe.info.libDir)
    targets.push(target)
    const r = await target.call<{ addr: string; md: string }>({ cmd: 'alloc', size: SIZE, seed })
    // The target runs this addon, so it advertises the disconnect probe.
    const peer = await reader.loadRemoteMetadata(Buffer.from(r.md, 'base64'), { probe: true })
    return { peer, addr: BigInt(r.addr) }
  }

  const first = await boot(11)
  const expected = patternBuffer(SIZE, 11)
  const read = () =>
    reader.read(first.peer, [{ addr: addressOf(local), len: SIZE }], [{ addr: first.addr, len: SIZE }], {
      timeoutMs: READ_TIMEOUT_MS,
    })

  // A few good reads establish the connection and the baseline.
  for (let i = 0; i < 3; i++) {
    await read()
    t.ok(local.equals(expected), `read ${i} before the kill is correct`)
  }

  // Keep reading back to back; kill the target while that series is running.
  const victim = targets[0]
  if (!victim) throw new Error('no target')
  let killedAt = 0
  const killer = setTimeout(() => {
    killedAt = Date.now()
    victim.child.kill('SIGKILL')
  }, 50)
  t.teardown(() => clearTimeout(killer))
  let failure: { code?: string; message?: string } | undefined
  let okAfterKill = 0
  const seriesDeadline = Date.now() + 30_000
  while (!failure && Date.now() < seriesDeadline) {
    try {
      await read()
      if (killedAt) okAfterKill++
    } catch (err) {
      failure = err as { code?: string; message?: string }
    }
  }
  t.ok(failure, 'a read failed after the kill')
  const detectMs = Date.now() - killedAt
  t.comment(`after kill: ${okAfterKill} reads still completed; error after ${detectMs} ms: ${failure?.code} ${failure?.message}`)
  t.ok(
    failure?.code === 'NAT_ERR_REMOTE_DISCONNECT' || failure?.code === 'NAT_ERR_XFER_TIMEOUT',
    `coded error (${failure?.code})`,
  )
  t.ok(detectMs < DETECT_BOUND_MS, `detected within ${DETECT_BOUND_MS} ms (${detectMs} ms)`)

  // Further reads fail fast with a code as well, until new metadata arrives.
  const again = await read().then(
    () => 'ok',
    (e: { code?: string }) => e.code,
  )
  t.match(again, /^NAT_ERR_/, `read before re-handshake: ${again}`)

  // Restart the target under the same name, forget the old incarnation, load the new one.
  await reader.forgetPeer(first.peer)
  const second = await boot(12)
  t.equal(second.peer, first.peer, 'restarted target has the same name')
  await reader.read(second.peer, [{ addr: addressOf(local), len: SIZE }], [{ addr: second.addr, len: SIZE }], {
    timeoutMs: 20_000,
  })
  t.ok(local.equals(patternBuffer(SIZE, 12)), 'reads the restarted target correctly')
})
