import { createServer } from 'node:http'
import type { AddressInfo } from 'node:net'
import t, { type Test } from 'tap'
import { systemClock, type Clock } from '../../common/clock.js'
import { createHandshake } from '../../transfer-agent/src/handshake-client.js'

// Issue 17 item 5: a handshake samples the peer's clock several times and keeps the tightest
// reading; every sample must come from the same NIXL agent. A real loopback server answers;
// the clock is scripted, so each sample's round trip is what the test says.

const answer = (engineId: string, clock: number, metadata = 'bWQ='): string =>
  JSON.stringify({ engineId, agentId: 'agent-p', metadata, clock, probe: true, region: { addr: '4096', len: 1024, blockBytes: 64, numBlocks: 16 } })

async function peer(t: Test, answers: ((n: number) => string)[]): Promise<{ address: string; calls: () => number }> {
  let n = 0
  const server = createServer((_req, res) => {
    const body = (answers[Math.min(n, answers.length - 1)] as (n: number) => string)(n)
    n++
    res.writeHead(200, { 'content-type': 'application/json' }).end(body)
  })
  await new Promise<void>((r) => server.listen(0, '127.0.0.1', r))
  t.teardown(() => new Promise<void>((r) => server.close(() => r())).then(() => server.closeAllConnections()))
  return { address: `127.0.0.1:${(server.address() as AddressInfo).port}`, calls: () => n }
}

/** monotonic() answers these in turn: a sample reads it when it sends and when the answer came. */
function scripted(times: number[]): Clock {
  let i = 0
  return { ...systemClock, monotonic: () => times[Math.min(i++, times.length - 1)] as number }
}

t.test('several samples, the tightest kept', async (t) => {
  // Round trips 40, 4 and 20 ms; P's clock reads 1000.5 s in the middle of each.
  const p = await peer(t, [() => answer('p0', 1000.02), () => answer('p0', 1000.102), () => answer('p0', 1000.21)])
  const hs = createHandshake({ clock: scripted([0, 40, 100, 104, 200, 220]), caller: 'test', timeoutMs: 2000, samples: 3 })
  t.teardown(() => hs.close())
  const r = await hs.handshake(p.address, 'p0', new AbortController().signal)
  t.equal(p.calls(), 3, 'three samples')
  t.equal(r.clock.rttMs, 4, 'the lowest round trip is kept')
  t.equal(r.clock.uncertaintyMs, 2)
  t.equal(Math.round(r.clock.offsetMs), 1000_102 - 102)
  t.equal(r.engineId, 'p0')
})

t.test('one sample when asked; a peer that changes between samples fails the handshake', async (t) => {
  const one = await peer(t, [() => answer('p0', 5)])
  const hs1 = createHandshake({ clock: systemClock, caller: 'test', timeoutMs: 2000, samples: 1 })
  t.teardown(() => hs1.close())
  await hs1.handshake(one.address, 'p0', new AbortController().signal)
  t.equal(one.calls(), 1)

  const flips = await peer(t, [() => answer('p0', 5), () => answer('p1', 5)])
  const hs = createHandshake({ clock: systemClock, caller: 'test', timeoutMs: 2000 })
  t.teardown(() => hs.close())
  await t.rejects(hs.handshake(flips.address, 'p0', new AbortController().signal), /changed while it was sampled \(p0 → p1\)/)
  const remd = await peer(t, [() => answer('p0', 5, 'bWQ='), () => answer('p0', 5, 'b3RoZXI=')])
  await t.rejects(hs.handshake(remd.address, 'p0', new AbortController().signal), /changed while it was sampled/, 'the same engine_id with another NIXL agent too')
  t.throws(() => createHandshake({ clock: systemClock, caller: 'test', timeoutMs: 10, samples: 0 }), RangeError)
})
