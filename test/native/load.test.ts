// Loading: the addon always loads; a wrong or empty NIXL_LIB_DIR gives clean coded errors;
// the real library loads, lists UCX and reports its version.
import { existsSync, mkdirSync, mkdtempSync, rmSync, symlinkSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import t from 'tap'
import { createAgent, loadNixl, loadedNixlPath, mapSharedMemory, NAT_ERR_NIXL_NOT_AVAILABLE, type Registration } from '../../native/index.js'
import { describeNixl, needNixl, probeNixl } from './helpers.js'

const scratch = mkdtempSync(join(tmpdir(), 'handoff-nixl-load-'))
t.teardown(() => rmSync(scratch, { recursive: true, force: true }))

// These run before anything loads the real library: the loader is process-wide.
t.test('NIXL_LIB_DIR pointing at an empty folder', async (t) => {
  const empty = join(scratch, 'empty')
  mkdirSync(empty)
  const err = await loadNixl({ libDir: empty, python: null }).catch((e: unknown) => e)
  t.type(err, NAT_ERR_NIXL_NOT_AVAILABLE, 'an instance of the coded class')
  t.match(err, { code: 'NAT_ERR_NIXL_NOT_AVAILABLE', statusCode: 503, message: /no libnixl_capi\.so in/ })
  t.equal(loadedNixlPath(), null, 'nothing loaded')
  await t.rejects(createAgent('never'), { code: 'NAT_ERR_NIXL_NOT_AVAILABLE' }, 'agents report it too')
  // The addon itself works without NIXL.
  const shm = mapSharedMemory(`/handoff-load-${process.pid}`, 4096, { create: true })
  t.equal(shm.size, 4096, 'shared memory still works')
  shm.unlink()
  shm.unmap()
})

t.test('not a shared object, and a library without the C API', async (t) => {
  const junk = join(scratch, 'junk')
  mkdirSync(junk)
  writeFileSync(join(junk, 'libnixl_capi.so'), 'not an ELF file')
  await t.rejects(loadNixl({ libDir: junk }), { code: 'NAT_ERR_NIXL_NOT_AVAILABLE' }, 'dlopen failure')

  const libm = ['/lib/x86_64-linux-gnu/libm.so.6', '/usr/lib64/libm.so.6', '/lib64/libm.so.6'].find((p) => existsSync(p))
  if (!libm) {
    t.comment('no libm to stand in for a library without the symbols')
    return
  }
  const other = join(scratch, 'other')
  mkdirSync(other)
  symlinkSync(libm, join(other, 'libnixl_capi.so'))
  await t.rejects(
    loadNixl({ libDir: other }),
    { code: 'NAT_ERR_NIXL_SYMBOL_MISSING', message: /nixl_capi_create_agent/ },
    'the first missing symbol is named',
  )
  await t.rejects(loadNixl({ libDir: 'relative/dir' }), { code: 'NAT_ERR_NIXL_NOT_AVAILABLE' })
})

t.test('the real library', async (t) => {
  // Probed here, not at the top: the tests above must run before anything loads NIXL.
  const probe = await probeNixl()
  const skip = needNixl(t, probe)
  if (skip) t.plan(0, skip)
  if (!probe.ok) return
  t.comment(describeNixl(probe.info))
  t.ok(probe.info.version, 'version read from the dist-info name')
  t.equal(loadedNixlPath(), probe.info.path)
  const again = await loadNixl({ libDir: probe.info.libDir })
  t.equal(again.path, probe.info.path, 'loading the same directory again is a no-op')
  const other = join(scratch, 'other2')
  mkdirSync(other)
  writeFileSync(join(other, 'libnixl_capi.so'), '')
  await t.rejects(loadNixl({ libDir: other }), { code: 'NAT_ERR_ALREADY_LOADED' }, 'a second copy is refused')

  const agent = await createAgent(`load-${process.pid}`, { progressThread: false, syncMode: 'rw' })
  const plugins = await agent.listPlugins()
  t.ok(plugins.includes('UCX'), `plugins: ${plugins.join(', ')}`)
  t.comment(`plugins available: ${plugins.join(', ')}`)
  const ucx = await agent.pluginParams('UCX')
  t.ok(ucx.mems.includes('dram'), 'UCX serves DRAM')
  await t.rejects(agent.pluginParams('NO_SUCH_PLUGIN'), { code: 'NAT_ERR_PLUGIN_MISSING' })
  await t.rejects(agent.createBackend('NO_SUCH_PLUGIN'), { code: 'NAT_ERR_BACKEND_CREATE' })
  await t.rejects(agent.localMetadata(), { code: /^NAT_ERR_NIXL_/ }, 'no backend, no metadata')
  const backend = await agent.createBackend('UCX', { num_workers: '1' })
  t.equal(backend.plugin, 'UCX')
  t.comment(`UCX backend params in effect: ${JSON.stringify(backend.params)}`)
  // DRAM registration round trip, and VRAM, which a CPU-only node cannot register.
  const buf = Buffer.alloc(8192)
  const reg = await agent.registerMemory(buf)
  await t.rejects(agent.deregisterMemory({ ...reg } as unknown as Registration), { code: 'NAT_ERR_INVALID_ARG' }, 'unknown registration')
  await agent.deregisterMemory(reg)
  const vram = await agent.registerMemory({ addr: 0x10000n, len: 4096, devId: 0, kind: 'vram' }).then(
    () => 'registered',
    (e: { code?: string }) => e.code,
  )
  t.comment(`VRAM registration on this machine: ${vram}`)
  t.match(vram, /^(NAT_ERR_REGISTER|registered)$/)
  await t.rejects(agent.loadRemoteMetadata(Buffer.from('garbage')), { code: 'NAT_ERR_METADATA_REJECTED' })
  await agent.forgetPeer('nobody') // unknown engine_id: a no-op
  t.equal(await agent.checkPeer('nobody'), false)
  await t.rejects(agent.genNotif('nobody', 'x'), { code: 'NAT_ERR_PEER_UNKNOWN' })
  await t.rejects(
    agent.read('nobody', [{ addr: 1n, len: 8 }], [{ addr: 1n, len: 8 }]),
    { code: 'NAT_ERR_PEER_UNKNOWN' },
    'read from a peer never loaded',
  )
  await t.rejects(agent.read('nobody', [{ addr: 1n, len: 0 }], [{ addr: 1n, len: 0 }]), { code: 'NAT_ERR_INVALID_ARG' })
  await t.rejects(agent.registerMemory(Buffer.alloc(0)), { code: 'NAT_ERR_INVALID_ARG' })
  await agent.close()
  await agent.close() // idempotent
  await t.rejects(agent.listPlugins(), { code: 'NAT_ERR_AGENT_CLOSED' })
  await t.rejects(agent.read('nobody', [{ addr: 1n, len: 8 }], [{ addr: 1n, len: 8 }]), { code: 'NAT_ERR_AGENT_CLOSED' })
  await t.rejects(createAgent(''), { code: 'NAT_ERR_INVALID_ARG' })
})
