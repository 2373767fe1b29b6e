// Shared memory: one region written by this process (the "simulator") and read through NIXL
// by another (the target maps it by name and registers it; this process READs it back).
import v8 from 'node:v8'
import vm from 'node:vm'
import t from 'tap'
import { addressOf, mapSharedMemory, unlinkSharedMemory, type SharedMemory } from '../../native/index.js'
import { fillPattern, patternBuffer } from './fixtures/pattern.js'
import { describeNixl, needNixl, probeNixl, readerAgent, startTarget } from './helpers.js'

const probe = await probeNixl()

t.test('map, share, unmap, unlink (no NIXL needed)', async (t) => {
  const name = `/handoff-shm-unit-${process.pid}`
  t.teardown(() => {
    unlinkSharedMemory(name)
  })
  const a = mapSharedMemory(name, 1 << 20, { create: true, exclusive: true })
  t.equal(a.size, 1 << 20)
  t.equal(a.address, addressOf(a.buffer), 'address is the mapping start')
  // A second mapping of the same object sees the same bytes.
  const b = mapSharedMemory(name, 0)
  t.equal(b.size, 1 << 20, 'size 0 maps the whole object')
  new Uint8Array(a.buffer).set([1, 2, 3], 100)
  t.same([...new Uint8Array(b.buffer, 100, 3)], [1, 2, 3], 'writes through one mapping show in the other')
  t.throws(() => mapSharedMemory(name, 4096, { create: true, exclusive: true }), { code: 'NAT_ERR_SHM' }, 'exclusive create of an existing name')
  t.throws(() => mapSharedMemory(name, 2 << 20), { code: 'NAT_ERR_SHM' }, 'larger than the object')
  t.throws(() => mapSharedMemory('no-slash', 4096, { create: true }), { code: 'NAT_ERR_INVALID_ARG' })
  t.throws(() => mapSharedMemory(`/handoff-missing-${process.pid}`, 4096), { code: 'NAT_ERR_SHM' }, 'missing object')
  b.unmap()
  t.equal(b.buffer.byteLength, 0, 'unmapped buffer is detached')
  b.unmap() // idempotent
  t.equal(a.unlink(), true)
  t.equal(unlinkSharedMemory(name), false, 'second unlink reports absence')
  t.equal(new Uint8Array(a.buffer)[101], 2, 'mapping stays valid after unlink')
  a.unmap()
})

t.test('shared region written here, read through NIXL by another process', { skip: needNixl(t, probe) }, async (t) => {
  if (!probe.ok) return
  t.comment(describeNixl(probe.info))
  const size = 4 << 20
  const name = `/handoff-shm-nixl-${process.pid}`
  const shm = mapSharedMemory(name, size, { create: true, exclusive: true })
  t.teardown(() => {
    shm.unlink()
  })
  fillPattern(new Uint8Array(shm.buffer), 21)

  const target = await startTarget(`target-shm-${process.pid}`, probe.info.libDir)
  t.teardown(() => target.kill())
  // The target maps the region by name and registers it; it never writes to it.
  const reg = await target.call<{ addr: string; len: number; md: string }>({ cmd: 'map-shm', name, size })
  t.equal(reg.len, size)

  const reader = await readerAgent(`reader-shm-${process.pid}`)
  t.teardown(() => reader.close())
  const local = Buffer.alloc(size)
  await reader.registerMemory(local)
  const peer = await reader.loadRemoteMetadata(Buffer.from(reg.md, 'base64'))
  const read = () => reader.read(peer, [{ addr: addressOf(local), len: size }], [{ addr: BigInt(reg.addr), len: size }], { timeoutMs: 20_000 })

  await read()
  t.ok(local.equals(patternBuffer(size, 21)), 'bytes written here came back through the target')
  // Rewrite in place: the target's registration is the same pages, so the next READ sees it.
  fillPattern(new Uint8Array(shm.buffer), 22)
  await read()
  t.ok(local.equals(patternBuffer(size, 22)), 'a later write is visible through NIXL too')
  await target.call({ cmd: 'exit' }).catch(() => undefined)
})

// Regression (found while fixing issue #7 item 2): after unmap() the kernel may give the same
// address to the next mapping, and the old ArrayBuffer's finalizer, run at a later GC, used to
// unmap the new mapping by address. A crash (SIGSEGV) here is the failure.
t.test('collecting an unmapped buffer leaves a new mapping at the same address alone', async (t) => {
  v8.setFlagsFromString('--expose-gc')
  const gc = vm.runInNewContext('gc') as () => void
  const name = `/handoff-shm-gen-${process.pid}`
  t.teardown(() => {
    unlinkSharedMemory(name)
    unlinkSharedMemory(`${name}-2`)
  })
  let first: SharedMemory | null = mapSharedMemory(name, 1 << 20, { create: true })
  const oldAddress = first.address
  first.unmap()
  first = null
  const second = mapSharedMemory(`${name}-2`, 1 << 20, { create: true })
  t.comment(`new mapping ${second.address === oldAddress ? 'reuses' : 'does not reuse'} the old address`)
  for (let i = 0; i < 5; i++) {
    gc()
    await new Promise((resolve) => setTimeout(resolve, 10))
  }
  new Uint8Array(second.buffer)[4096] = 42
  t.equal(new Uint8Array(second.buffer)[4096], 42, 'the new mapping is still there')
  second.unmap()
})

// An agent must never map a region another agent has attached (issue 18 §4): with `lock`, the
// object is held exclusively until the mapping goes, from this process or any other.
t.test('a locked mapping refuses a second locked mapping until it is unmapped', async (t) => {
  const name = `/handoff-shm-lock-${process.pid}`
  t.teardown(() => unlinkSharedMemory(name))
  const first = mapSharedMemory(name, 4096, { create: true, lock: true })
  t.throws(() => mapSharedMemory(name, 4096, { lock: true }), { code: 'NAT_ERR_SHM', message: /held by another mapping/ }, 'held')
  const plain = mapSharedMemory(name, 4096)
  t.pass('a mapping without the lock is not refused (the engine maps its own region)')
  plain.unmap()
  first.unmap()
  const again = mapSharedMemory(name, 4096, { lock: true })
  t.equal(again.size, 4096, 'free again once unmapped')
  again.unmap()
})
