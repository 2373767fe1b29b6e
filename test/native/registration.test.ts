// Issue #7 item 2: memory under a READ can be neither deregistered, unmapped nor closed away.
// Before the fix, deregistering halfway through a tcp READ succeeded and the READ finished
// "ok" into the deregistered buffer; close() deregistered before it canceled; shm.unmap()
// checked nothing. Also the tainted path: a READ aborted while its peer is stopped (SIGSTOP)
// cannot be confirmed done, so it settles as NAT_ERR_XFER_TAINTED and keeps its memory
// pinned until the peer runs again and NIXL reports it done.
import t, { type Test } from 'tap'
import { isTainted, mapSharedMemory, type NixlAgent } from '../../native/index.js'
import { describeNixl, needNixl, probeNixl, readerAgent, startTarget, type Target } from './helpers.js'

const probe = await probeNixl()
const skip = needNixl(t, probe)
const MiB = 1 << 20
const SIZE = 64 * MiB

const sleep = (ms: number): Promise<void> => new Promise((resolve) => setTimeout(resolve, ms))

// Everything here runs over tcp: UCX emulates the get with messages the target must serve,
// so a READ stays in flight long enough to act on, and stops while the target is stopped.
async function setup(
  t: Test,
  tag: string,
  quiesceMs = 5000,
): Promise<{ reader: NixlAgent; target: Target; peer: string; remoteAddr: bigint }> {
  if (!probe.ok) throw new Error('unreachable')
  const saved = process.env.UCX_TLS
  process.env.UCX_TLS = 'tcp'
  let reader: NixlAgent
  try {
    reader = await readerAgent(`reader-reg-${tag}-${process.pid}`, { quiesceMs })
  } finally {
    if (saved === undefined) delete process.env.UCX_TLS
    else process.env.UCX_TLS = saved
  }
  t.teardown(() => reader.close())
  const target = await startTarget(`target-reg-${tag}-${process.pid}`, probe.info.libDir, { UCX_TLS: 'tcp' })
  t.teardown(async () => {
    target.child.kill('SIGCONT')
    await target.kill()
  })
  const r = await target.call<{ addr: string; md: string }>({ cmd: 'alloc', size: SIZE, seed: 9 })
  const peer = await reader.loadRemoteMetadata(Buffer.from(r.md, 'base64'))
  return { reader, target, peer, remoteAddr: BigInt(r.addr) }
}

t.test('deregister refuses (or waits) while a READ writes into the memory', { skip }, async (t) => {
  if (!probe.ok) return
  t.comment(describeNixl(probe.info))
  const { reader, peer, remoteAddr } = await setup(t, 'dereg')
  const local = Buffer.alloc(SIZE)
  const reg = await reader.registerMemory(local)
  const read = reader.read(peer, [reg.slice(0, SIZE)], [{ addr: remoteAddr, len: SIZE }], { timeoutMs: 30_000 })
  let settled = false
  void read.then(
    () => (settled = true),
    () => (settled = true),
  )
  t.equal(reg.readers, 1, 'the registration counts the READ')
  await t.rejects(reader.deregisterMemory(reg), { code: 'NAT_ERR_MEMORY_IN_USE' }, 'deregister refuses while the READ is in flight')
  await reader.deregisterMemory(reg, { wait: true })
  t.ok(settled, 'deregister { wait: true } resolved only after the READ settled')
  t.equal(reg.readers, 0)
  await read
  await t.rejects(
    reader.read(peer, [reg.slice(0, 4096)], [{ addr: remoteAddr, len: 4096 }]),
    { code: 'NAT_ERR_INVALID_ARG' },
    'a READ into deregistered memory is refused',
  )
  await t.rejects(
    reader.read(peer, [{ addr: reg.addr - 4096n, len: 4096 }], [{ addr: remoteAddr, len: 4096 }]),
    { code: 'NAT_ERR_INVALID_ARG' },
    'a READ into memory never registered is refused',
  )
})

t.test('shared memory cannot be unmapped while registered', { skip }, async (t) => {
  if (!probe.ok) return
  const reader = await readerAgent(`reader-reg-shm-${process.pid}`)
  t.teardown(() => reader.close())
  const name = `/handoff-reg-shm-${process.pid}`
  const shm = mapSharedMemory(name, 4 * MiB, { create: true, exclusive: true })
  t.teardown(() => {
    shm.unlink()
  })
  const reg = await reader.registerMemory(shm.buffer)
  t.throws(() => shm.unmap(), { code: 'NAT_ERR_MEMORY_IN_USE' }, 'unmap refuses while registered')
  t.equal(shm.buffer.byteLength, 4 * MiB, 'still mapped')
  await reader.deregisterMemory(reg)
  shm.unmap()
  t.equal(shm.buffer.byteLength, 0, 'unmapped once deregistered')

  // close() unpins what it deregisters too.
  const shm2 = mapSharedMemory(`${name}-2`, 4 * MiB, { create: true, exclusive: true })
  t.teardown(() => {
    shm2.unlink()
  })
  const other = await readerAgent(`reader-reg-shm2-${process.pid}`)
  await other.registerMemory(shm2.buffer)
  t.throws(() => shm2.unmap(), { code: 'NAT_ERR_MEMORY_IN_USE' })
  await other.close()
  shm2.unmap()
  t.equal(shm2.buffer.byteLength, 0, 'unmapped after the agent closed')
})

t.test('close cancels and quiesces READs before it deregisters', { skip }, async (t) => {
  if (!probe.ok) return
  const { reader, peer, remoteAddr } = await setup(t, 'close')
  const local = Buffer.alloc(SIZE)
  const reg = await reader.registerMemory(local)
  const read = reader
    .read(peer, [reg.slice(0, SIZE)], [{ addr: remoteAddr, len: SIZE }], { timeoutMs: 30_000 })
    .then(
      () => 'completed',
      (e: { code?: string }) => e.code,
    )
  await sleep(5)
  await reader.close()
  const outcome = await read
  // close() cancels what is in flight; a READ that finished first is fine too.
  t.ok(['completed', 'NAT_ERR_XFER_CANCELED', 'NAT_ERR_AGENT_CLOSED'].includes(outcome ?? ''), `READ in flight at close: ${outcome}`)
  const snapshot = Buffer.from(local)
  await sleep(1000)
  t.ok(snapshot.equals(local), 'no byte changed after close resolved')
})

t.test('a READ aborted under a stopped peer is tainted and stays pinned until quiescent', { skip }, async (t) => {
  if (!probe.ok) return
  const { reader, target, peer, remoteAddr } = await setup(t, 'taint', 300)
  const local = Buffer.alloc(SIZE)
  const reg = await reader.registerMemory(local)
  // Warm-up: the connection exists before the target stops.
  await reader.read(peer, [reg.slice(0, 4096)], [{ addr: remoteAddr, len: 4096 }], { timeoutMs: 20_000 })
  local.fill(0)
  target.child.kill('SIGSTOP')
  const err = await reader
    .read(peer, [reg.slice(0, SIZE)], [{ addr: remoteAddr, len: SIZE }], { timeoutMs: 200 })
    .catch((e: unknown) => e)
  t.ok(isTainted(err), `aborted READ under a stopped peer: ${(err as { code?: string }).code}`)
  if (!isTainted(err)) return
  t.same(err.ranges, [{ addr: reg.addr, len: SIZE, devId: 0 }], 'the tainted ranges are reported')
  t.equal(reg.readers, 1, 'the registration stays pinned')
  await t.rejects(reader.deregisterMemory(reg), { code: 'NAT_ERR_MEMORY_IN_USE' })
  t.equal(reader.stats().tainted, 1)
  let quiesced = false
  void err.quiesced.then(() => (quiesced = true))
  await sleep(300)
  t.notOk(quiesced, 'not quiescent while the peer is stopped')
  target.child.kill('SIGCONT')
  await Promise.race([err.quiesced, sleep(20_000)])
  t.ok(quiesced, 'quiescent once the peer ran again and NIXL reported the READ done')
  t.equal(reg.readers, 0, 'unpinned')
  const pages = countNonZeroPages(local)
  t.comment(`pages written by the aborted READ after it settled as tainted: ${pages}`)
  const snapshot = Buffer.from(local)
  await sleep(1000)
  t.ok(snapshot.equals(local), 'no byte changed after the tainted READ became quiescent')
  await reader.deregisterMemory(reg)
})

function countNonZeroPages(buf: Buffer): number {
  const zero = Buffer.alloc(4096)
  let n = 0
  for (let off = 0; off < buf.length; off += 4096) if (!buf.subarray(off, off + 4096).equals(zero)) n++
  return n
}
