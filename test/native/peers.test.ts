// Issue #7: peers by engine_id (forgetPeer, NAT_ERR_PEER_GONE vs NAT_ERR_PEER_UNKNOWN, a
// restarted peer under a new engine_id), the disconnect event, and item 7: the disconnect
// probe goes only to peers that advertised it. Before, every ambiguous backend error sent
// the probe to any peer (a stock vLLM connector would see a stray message).
import t from 'tap'
import { type DisconnectEvent, type NixlAgent } from '../../native/index.js'
import { patternBuffer } from './fixtures/pattern.js'
import { describeNixl, needNixl, probeNixl, readerAgent, startTarget } from './helpers.js'

const probe = await probeNixl()
const skip = needNixl(t, probe)
const MiB = 1 << 20

t.test('engine_ids: forgetPeer fails new reads at once, waits for reads in flight, then invalidates', { skip }, async (t) => {
  if (!probe.ok) return
  t.comment(describeNixl(probe.info))
  const saved = process.env.UCX_TLS
  process.env.UCX_TLS = 'tcp' // slow enough that a 64 MiB READ is still in flight below
  let reader: NixlAgent
  try {
    reader = await readerAgent(`reader-peers-${process.pid}`)
  } finally {
    if (saved === undefined) delete process.env.UCX_TLS
    else process.env.UCX_TLS = saved
  }
  t.teardown(() => reader.close())
  const target = await startTarget(`target-peers-${process.pid}`, probe.info.libDir, { UCX_TLS: 'tcp' })
  t.teardown(() => target.kill())
  const r = await target.call<{ addr: string; md: string }>({ cmd: 'alloc', size: 64 * MiB, seed: 3 })
  const info = await reader.loadPeer('engine-A', Buffer.from(r.md, 'base64'), { probe: true })
  t.same(info, { engineId: 'engine-A', name: target.name, probe: true })
  t.same(reader.peers(), [info])
  t.equal(await reader.checkPeer('engine-A'), true)
  t.equal(await reader.checkPeer('engine-B'), false, 'an engine_id never loaded is not present')
  const local = Buffer.alloc(64 * MiB)
  const reg = await reader.registerMemory(local)
  const remote = [{ addr: BigInt(r.addr), len: 64 * MiB }]
  await reader.read('engine-A', [reg.slice(0, 4096)], [{ addr: BigInt(r.addr), len: 4096 }])
  await t.rejects(reader.read('engine-B', [reg.slice(0, 4096)], remote), { code: 'NAT_ERR_PEER_UNKNOWN' })

  const inFlight = reader.read('engine-A', [reg.slice(0, 64 * MiB)], remote, { timeoutMs: 30_000 }).then(
    () => 'completed',
    (e: { code?: string }) => e.code,
  )
  let forgotten = false
  const forget = reader.forgetPeer('engine-A').then(() => (forgotten = true))
  await t.rejects(
    reader.read('engine-A', [reg.slice(0, 4096)], [{ addr: BigInt(r.addr), len: 4096 }]),
    { code: 'NAT_ERR_PEER_GONE' },
    'a new READ fails at once while the peer is being forgotten',
  )
  t.notOk(forgotten, 'forgetPeer waits for the READ in flight')
  t.equal(await inFlight, 'completed', 'the READ in flight finished normally')
  await forget
  t.equal(await reader.checkPeer('engine-A'), false, 'invalidated after the READ settled')
  t.ok(local.equals(patternBuffer(64 * MiB, 3)), 'bytes of the READ that finished during forgetPeer are right')
  await t.rejects(reader.read('engine-A', [reg.slice(0, 4096)], remote), { code: 'NAT_ERR_PEER_GONE' })
  await reader.forgetPeer('engine-A') // idempotent
  await reader.forgetPeer('never-loaded') // unknown: no-op
  t.same(reader.peers(), [])

  // The same process under a new engine_id (a reconnect) loads again.
  await reader.loadPeer('engine-A2', Buffer.from(r.md, 'base64'))
  await reader.read('engine-A2', [reg.slice(0, 4096)], [{ addr: BigInt(r.addr), len: 4096 }])
  t.pass('reads again under a new engine_id')
  await target.call({ cmd: 'exit' }).catch(() => undefined)
})

t.test('a restarted peer loaded under a new engine_id releases the old one', { skip }, async (t) => {
  if (!probe.ok) return
  const reader = await readerAgent(`reader-restart-${process.pid}`)
  t.teardown(() => reader.close())
  const name = `target-restart-${process.pid}`
  const first = await startTarget(name, probe.info.libDir)
  t.teardown(() => first.kill())
  const r1 = await first.call<{ addr: string; md: string }>({ cmd: 'alloc', size: MiB, seed: 1 })
  await reader.loadPeer('engine-1', Buffer.from(r1.md, 'base64'), { probe: true })
  const local = Buffer.alloc(MiB)
  const reg = await reader.registerMemory(local)
  await reader.read('engine-1', [reg.slice(0, MiB)], [{ addr: BigInt(r1.addr), len: MiB }])
  await first.kill()
  const second = await startTarget(name, probe.info.libDir)
  t.teardown(() => second.kill())
  const r2 = await second.call<{ addr: string; md: string }>({ cmd: 'alloc', size: MiB, seed: 2 })
  // Same NIXL agent name, new engine_id: NIXL would otherwise keep the dead endpoint.
  await reader.loadPeer('engine-2', Buffer.from(r2.md, 'base64'), { probe: true })
  await t.rejects(reader.read('engine-1', [reg.slice(0, MiB)], [{ addr: BigInt(r1.addr), len: MiB }]), {
    code: 'NAT_ERR_PEER_GONE',
  })
  await reader.read('engine-2', [reg.slice(0, MiB)], [{ addr: BigInt(r2.addr), len: MiB }], { timeoutMs: 20_000 })
  t.ok(local.equals(patternBuffer(MiB, 2)), 'reads the restarted peer')
  t.same(
    reader.peers().map((p) => p.engineId),
    ['engine-2'],
  )
})

for (const advertised of [true, false]) {
  t.test(`kill -9 of a peer that ${advertised ? 'advertised' : 'did not advertise'} the probe`, { skip }, async (t) => {
    if (!probe.ok) return
    const reader = await readerAgent(`reader-probe-${advertised}-${process.pid}`)
    t.teardown(() => reader.close())
    const target = await startTarget(`target-probe-${advertised}-${process.pid}`, probe.info.libDir)
    t.teardown(() => target.kill())
    const size = 8 * MiB
    const r = await target.call<{ addr: string; md: string }>({ cmd: 'alloc', size, seed: 4 })
    await reader.loadPeer('engine-P', Buffer.from(r.md, 'base64'), { probe: advertised })
    const reg = await reader.registerMemory(Buffer.alloc(size))
    const events: DisconnectEvent[] = []
    reader.on('disconnect', (e) => events.push(e))
    const read = (): Promise<unknown> =>
      reader.read('engine-P', [reg.slice(0, size)], [{ addr: BigInt(r.addr), len: size }], { timeoutMs: 5000 })
    await read()
    await target.kill()
    let code: string | undefined
    for (let i = 0; i < 20 && code === undefined; i++) {
      code = await read().then(
        () => undefined,
        (e: { code?: string }) => e.code,
      )
    }
    const { probesSent } = reader.stats()
    t.comment(`after kill: ${code}; probes sent: ${probesSent}; disconnect events: ${events.length}`)
    if (advertised) {
      t.ok(code === 'NAT_ERR_REMOTE_DISCONNECT' || code === 'NAT_ERR_XFER_TIMEOUT', `coded disconnect (${code})`)
      if (code === 'NAT_ERR_REMOTE_DISCONNECT') {
        t.ok(probesSent >= 1, 'the probe confirmed the disconnect')
        t.equal(events[0]?.engineId, 'engine-P', 'a disconnect event names the engine_id')
      }
    } else {
      t.equal(probesSent, 0, 'no probe notification toward a peer that did not advertise it')
      t.ok(code === 'NAT_ERR_NIXL_BACKEND' || code === 'NAT_ERR_XFER_TIMEOUT', `an ambiguous error stays a failed READ (${code})`)
      t.equal(events.length, 0, 'no disconnect is claimed')
      t.equal(await reader.checkPeer('engine-P'), true, 'the peer is left loaded: invalidation is the control plane’s call')
    }
  })
}
