// Real NIXL READs over UCX between this process (reader) and a target child process.
import t from 'tap'
import { addressOf, packDescriptors, type Descriptor, type NixlAgent } from '../../native/index.js'
import { patternBuffer } from './fixtures/pattern.js'
import { describeNixl, needNixl, probeNixl, readerAgent, startTarget, waitForTargetNotification, type Target } from './helpers.js'

const probe = await probeNixl()
const skip = needNixl(t, probe)

interface Region {
  addr: bigint
  len: number
  md: string
}

t.test('two-process READs over UCX', { skip }, async (t) => {
  if (!probe.ok) return
  t.comment(describeNixl(probe.info))
  const reader: NixlAgent = await readerAgent(`reader-${process.pid}`)
  t.teardown(() => reader.close())
  const plugins = await reader.listPlugins()
  t.ok(plugins.includes('UCX'), 'UCX plugin listed')
  const ucx = await reader.pluginParams('UCX')
  t.comment(`plugin UCX: mems ${ucx.mems.join(',')}; defaults ${JSON.stringify(ucx.params)}`)

  const target: Target = await startTarget(`target-${process.pid}`, probe.info.libDir)
  t.teardown(() => target.kill())

  const MiB = 1 << 20
  const sizes = [4096, 64 * 1024, MiB, 16 * MiB, 64 * MiB]
  /** The first remote block i that did not land in local slot count − 1 − i (the scatter both block tests use), or −1. */
  const firstMisplacedBlock = (local: Buffer, count: number, block: number): number => {
    const expected = patternBuffer(64 * MiB, sizes.indexOf(64 * MiB) + 1)
    for (let i = 0; i < count; i++) {
      const got = local.subarray((count - 1 - i) * block, (count - i) * block)
      if (!got.equals(expected.subarray(i * block, (i + 1) * block))) return i
    }
    return -1
  }
  const local = Buffer.alloc(64 * MiB)
  const registration = await reader.registerMemory(local)
  const localAddr = addressOf(local)

  const regions = new Map<number, Region>()
  for (const [i, size] of sizes.entries()) {
    const r = await target.call<{ addr: string; len: number; md: string }>({ cmd: 'alloc', size, seed: i + 1 })
    regions.set(size, { addr: BigInt(r.addr), len: r.len, md: r.md })
  }
  // Metadata taken after the last registration describes every region.
  const lastMd = regions.get(64 * MiB)?.md ?? ''
  const peer = await reader.loadRemoteMetadata(Buffer.from(lastMd, 'base64'))
  t.equal(peer, target.name, 'loadRemoteMetadata returns the peer name')
  t.equal(await reader.checkPeer(peer), true, 'peer metadata present')

  await t.test('4 KiB to 64 MiB, byte for byte', async (t) => {
    for (const [i, size] of sizes.entries()) {
      const region = regions.get(size)
      if (!region) throw new Error('missing region')
      local.fill(0, 0, size)
      const res = await reader.read(peer, [{ addr: localAddr, len: size }], [{ addr: region.addr, len: size }], {
        timeoutMs: 20_000,
      })
      t.equal(res.bytes, size, `${size} bytes reported`)
      const expected = patternBuffer(size, i + 1)
      t.ok(local.subarray(0, size).equals(expected), `${size} bytes match (${(res.micros / 1000).toFixed(1)} ms)`)
    }
  })

  await t.test('1,000 x 16 KiB descriptors in one request', async (t) => {
    const block = 16 * 1024
    const count = 1000
    const src = regions.get(64 * MiB)
    if (!src) throw new Error('missing region')
    // Scatter: remote block i -> local block (count - 1 - i), so order mistakes show up.
    const remote: Descriptor[] = []
    const localDescs: Descriptor[] = []
    for (let i = 0; i < count; i++) {
      remote.push({ addr: src.addr + BigInt(i * block), len: block })
      localDescs.push({ addr: localAddr + BigInt((count - 1 - i) * block), len: block })
    }
    local.fill(0)
    const res = await reader.read(peer, packDescriptors(localDescs), packDescriptors(remote), { timeoutMs: 20_000 })
    t.equal(res.bytes, count * block)
    t.equal(firstMisplacedBlock(local, count, block), -1, 'every block landed in its slot')
  })

  await t.test('prepared block lists: 1,024 x 16 KiB by index', async (t) => {
    const block = 16 * 1024
    const count = 1024
    const src = regions.get(64 * MiB)
    if (!src) throw new Error('missing region')
    const localReg = registration
    // Prepared once: the whole local registration and the peer's 64 MiB region as blocks.
    const mine = await reader.prepareLocalBlocks(localReg, block)
    const theirs = await reader.prepareRemoteBlocks(peer, { addr: src.addr, len: 64 * MiB }, block)
    t.equal(mine.count, (64 * MiB) / block)
    // Scatter: remote block i -> local block (count - 1 - i).
    const remoteIdx = Array.from({ length: count }, (_, i) => i)
    const localIdx = remoteIdx.map((i) => count - 1 - i)
    local.fill(0)
    const res = await reader.readBlocks(peer, mine, localIdx, theirs, remoteIdx, { timeoutMs: 20_000 })
    t.equal(res.bytes, count * block)
    t.equal(firstMisplacedBlock(local, count, block), -1, 'every block landed in its slot')
    await t.rejects(reader.readBlocks(peer, mine, [0], theirs, [mine.count + 10]), { code: 'NAT_ERR_INVALID_ARG' }, 'index out of range')
    await t.rejects(reader.readBlocks(peer, theirs, [0], mine, [0]), { code: 'NAT_ERR_INVALID_ARG' }, 'lists swapped')
    await reader.releaseBlocks(mine)
    await reader.releaseBlocks(theirs)
    await t.rejects(reader.releaseBlocks(mine), { code: 'NAT_ERR_INVALID_ARG' }, 'released twice')
  })

  await t.test('notification arrives after its READ', async (t) => {
    const region = regions.get(MiB)
    if (!region) throw new Error('missing region')
    const tag = `read-done:${process.pid}:${Date.now()}`
    await reader.read(peer, [{ addr: localAddr, len: MiB }], [{ addr: region.addr, len: MiB }], { notif: tag })
    // The READ has completed on this side; the target must see the notification shortly after.
    const hit = await waitForTargetNotification(target, tag)
    t.ok(hit, 'target received the notification')
    t.equal(hit?.peer, reader.name, 'notification names the reader')
  })

  await t.test('genNotif reaches the target', async (t) => {
    await reader.genNotif(peer, 'hello')
    t.ok(await waitForTargetNotification(target, 'hello'), 'target received the genNotif message')
  })

  await t.test('outside the registered region -> coded error', async (t) => {
    const region = regions.get(4096)
    if (!region) throw new Error('missing region')
    const err = await reader
      .read(peer, [{ addr: localAddr, len: 8192 }], [{ addr: region.addr + 1_000_000_000n, len: 8192 }], { timeoutMs: 5000 })
      .catch((e: unknown) => e)
    t.type(err, Error)
    t.match(err, { code: /^NAT_ERR_NIXL_/ }, 'a NIXL status error with a code')
    t.comment(`error: ${(err as Error).message}`)
  })

  await t.test('cancel via AbortSignal', async (t) => {
    const region = regions.get(64 * MiB)
    if (!region) throw new Error('missing region')
    const ac = new AbortController()
    ac.abort()
    await t.rejects(
      reader.read(peer, [{ addr: localAddr, len: 4096 }], [{ addr: region.addr, len: 4096 }], { signal: ac.signal }),
      { code: 'NAT_ERR_XFER_CANCELED' },
    )
    // In flight: 64 MiB takes long enough over tcp that the cancel lands first, but a fast
    // machine may finish; either outcome is correct, a hang or other error is not.
    const ac2 = new AbortController()
    const p = reader.read(peer, [{ addr: localAddr, len: 64 * MiB }], [{ addr: region.addr, len: 64 * MiB }], {
      signal: ac2.signal,
      timeoutMs: 20_000,
    })
    ac2.abort()
    const outcome = await p.then(
      () => 'completed',
      (e: { code?: string }) => e.code,
    )
    t.ok(outcome === 'completed' || outcome === 'NAT_ERR_XFER_CANCELED', `in-flight cancel: ${outcome}`)
  })

  await t.test('forgetPeer, then read -> NAT_ERR_PEER_GONE; reload and read again', async (t) => {
    const region = regions.get(4096)
    if (!region) throw new Error('missing region')
    await reader.forgetPeer(peer)
    t.equal(await reader.checkPeer(peer), false, 'peer gone after forgetPeer')
    await t.rejects(
      reader.read(peer, [{ addr: localAddr, len: 4096 }], [{ addr: region.addr, len: 4096 }], { timeoutMs: 5000 }),
      { code: 'NAT_ERR_PEER_GONE' },
    )
    await reader.forgetPeer(peer) // idempotent
    await t.rejects(
      reader.read('never-loaded', [{ addr: localAddr, len: 4096 }], [{ addr: region.addr, len: 4096 }]),
      { code: 'NAT_ERR_PEER_UNKNOWN' },
      'a peer never loaded is unknown, not gone',
    )
    // And back: reload, read again.
    t.equal(await reader.loadRemoteMetadata(Buffer.from(lastMd, 'base64')), peer)
    const res = await reader.read(peer, [{ addr: localAddr, len: 4096 }], [{ addr: region.addr, len: 4096 }])
    t.equal(res.bytes, 4096, 'reads again after reloading metadata')
  })

  await target.call({ cmd: 'exit' }).catch(() => undefined)
})

