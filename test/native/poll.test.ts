// The poll thread and the notification stream (issue #7):
// - item 4: `timeoutMs: Infinity` (or 1e300) failed at once with NAT_ERR_XFER_TIMEOUT (an
//   undefined float-to-int conversion);
// - item 6: the poll thread took every queued READ and posted it before it looked at cancels,
//   holding the agent lock throughout, so a cancel that arrived before the post was posted
//   anyway (and over CMA, which copies inside the post, the READ then simply completed);
// - notifications: waitForNotification used to see only notifications arriving after the
//   call; now a bounded buffer keeps earlier ones, and an AbortSignal ends the wait.
import t from 'tap'
import { type NixlAgent } from '../../native/index.js'
import { describeNixl, needNixl, probeNixl, readerAgent, startTarget, waitForTargetNotification } from './helpers.js'

const probe = await probeNixl()
const skip = needNixl(t, probe)
const MiB = 1 << 20

t.test('poll thread and notifications', { skip }, async (t) => {
  if (!probe.ok) return
  t.comment(describeNixl(probe.info))
  const reader: NixlAgent = await readerAgent(`reader-poll-${process.pid}`)
  t.teardown(() => reader.close())
  const target = await startTarget(`target-poll-${process.pid}`, probe.info.libDir)
  t.teardown(() => target.kill())
  const BIG = 64 * MiB
  const r = await target.call<{ addr: string; md: string }>({ cmd: 'alloc', size: BIG, seed: 6 })
  const peer = await reader.loadRemoteMetadata(Buffer.from(r.md, 'base64'), { probe: true })
  const remoteAddr = BigInt(r.addr)
  const local = Buffer.alloc(BIG + 32 * 4 * MiB)
  const reg = await reader.registerMemory(local)

  await t.test('a READ canceled before it was posted is never posted', async (t) => {
    // One 64 MiB READ first: over CMA its post copies the whole region inline (tens of ms),
    // so the poll thread is busy while 32 more READs are queued and each is canceled right
    // after it was queued. The old loop posted everything it had dequeued before it looked at
    // cancels (and a CMA READ then simply completed); now each cancel is checked right
    // before its post.
    const big = reader.read(peer, [reg.slice(0, BIG)], [{ addr: remoteAddr, len: BIG }], { notif: `poll-big-${process.pid}` })
    const tags: string[] = []
    const reads: Promise<string>[] = []
    const t0 = Date.now()
    for (let i = 0; i < 32; i++) {
      const ac = new AbortController()
      const tag = `poll-${process.pid}-${i}`
      tags.push(tag)
      reads.push(
        reader
          .read(peer, [reg.slice(BIG + i * 4 * MiB, 4 * MiB)], [{ addr: remoteAddr, len: 4 * MiB }], { notif: tag, signal: ac.signal })
          .then(
            () => 'completed',
            (e: { code?: string; message?: string }) => (e.message?.includes('before it was posted') ? 'not posted' : (e.code ?? '?')),
          ),
      )
      ac.abort()
    }
    const queuedMs = Date.now() - t0
    // One-shot calls are not starved by the poll thread either (measured, not asserted).
    const c0 = Date.now()
    const check = reader.checkPeer(peer).then(() => Date.now() - c0)
    await big
    const outcomes = await Promise.all(reads)
    const checkMs = await check
    const counts = outcomes.reduce<Record<string, number>>((acc, o) => ({ ...acc, [o]: (acc[o] ?? 0) + 1 }), {})
    t.comment(
      `32 READs queued and canceled in ${queuedMs} ms behind a 64 MiB READ: ${JSON.stringify(counts)} after ${Date.now() - t0} ms; ` +
        `checkPeer meanwhile took ${checkMs} ms`,
    )
    const notPosted = outcomes.map((o, i) => (o === 'not posted' ? i : -1)).filter((i) => i >= 0)
    t.ok(notPosted.length > 0, `${notPosted.length} of 32 canceled READs were never posted`)
    t.ok(
      outcomes.every((o) => ['not posted', 'completed', 'NAT_ERR_XFER_CANCELED'].includes(o)),
      'every canceled READ settled with a known outcome',
    )
    // The big READ's notification reaches the target; none of a READ never posted does.
    t.ok(await waitForTargetNotification(target, `poll-big-${process.pid}`, 10_000), 'the 64 MiB READ notified the target')
    const { notifications } = await target.call<{ notifications: { message: string }[] }>({ cmd: 'notifications' })
    const seen = new Set(notifications.map((n) => n.message))
    t.notOk(
      notPosted.some((i) => seen.has(tags[i] ?? '')),
      'no notification of a READ that was never posted',
    )
  })

  await t.test('waitForNotification sees notifications that arrived earlier; AbortSignal ends a wait', async (t) => {
    // The target loads this reader's metadata so it can notify it.
    const md = (await reader.localMetadata()).toString('base64')
    const { peer: me } = await target.call<{ peer: string }>({ cmd: 'load', md })
    t.equal(me, reader.name)
    const early = `early-${process.pid}`
    const arrived = new Promise<void>((resolve) => {
      const on = (n: { message: Buffer }): void => {
        if (n.message.toString() !== early) return
        reader.off('notification', on)
        resolve()
      }
      reader.on('notification', on)
    })
    await target.call({ cmd: 'notify', peer: me, message: early })
    await arrived
    // Only now start waiting: the notification is already here.
    const n = await reader.waitForNotification((x) => x.message.toString() === early, { timeoutMs: 1000 })
    t.equal(n.peer, target.name, 'an earlier notification is found in the buffer')
    t.equal(n.engineId, peer, 'and names the engine_id it was loaded under')
    await t.rejects(
      reader.waitForNotification((x) => x.message.toString() === early, { timeoutMs: 200 }),
      { code: 'NAT_ERR_XFER_TIMEOUT' },
      'a matched notification is consumed',
    )
    const ac = new AbortController()
    const waiting = reader.waitForNotification(() => false, { timeoutMs: 60_000, signal: ac.signal })
    ac.abort()
    await t.rejects(waiting, { code: 'NAT_ERR_XFER_CANCELED' }, 'an AbortSignal ends the wait')
    const later = `later-${process.pid}`
    const pending = reader.waitForNotification((x) => x.message.toString() === later, 10_000)
    await target.call({ cmd: 'notify', peer: me, message: later })
    t.equal((await pending).message.toString(), later, 'a notification arriving during the wait resolves it')
    t.equal(reader.stats().notifErrors, 0, 'no notification drain failed')
  })

  await target.call({ cmd: 'exit' }).catch(() => undefined)
})

// Over tcp the READ is still in progress after the post (over CMA it completes inside the
// post, before any deadline is looked at), which is where Infinity used to time out at once.
t.test('timeoutMs Infinity and 1e300 mean "no deadline" (tcp)', { skip }, async (t) => {
  if (!probe.ok) return
  const saved = process.env.UCX_TLS
  process.env.UCX_TLS = 'tcp'
  let reader: NixlAgent
  try {
    reader = await readerAgent(`reader-inf-${process.pid}`)
  } finally {
    if (saved === undefined) delete process.env.UCX_TLS
    else process.env.UCX_TLS = saved
  }
  t.teardown(() => reader.close())
  const target = await startTarget(`target-inf-${process.pid}`, probe.info.libDir, { UCX_TLS: 'tcp' })
  t.teardown(() => target.kill())
  const r = await target.call<{ addr: string; md: string }>({ cmd: 'alloc', size: 4 * MiB, seed: 8 })
  const peer = await reader.loadRemoteMetadata(Buffer.from(r.md, 'base64'))
  const reg = await reader.registerMemory(Buffer.alloc(4 * MiB))
  for (const timeoutMs of [Infinity, 1e300, 2 ** 53]) {
    const res = await reader.read(peer, [reg.slice(0, 4 * MiB)], [{ addr: BigInt(r.addr), len: 4 * MiB }], { timeoutMs })
    t.equal(res.bytes, 4 * MiB, `timeoutMs ${timeoutMs}: completed`)
  }
  await t.rejects(
    reader.read(peer, [reg.slice(0, MiB)], [{ addr: BigInt(r.addr), len: MiB }], { timeoutMs: 0 }),
    { code: 'NAT_ERR_INVALID_ARG' },
    'timeoutMs 0 is a caller mistake',
  )
  await target.call({ cmd: 'exit' }).catch(() => undefined)
})
