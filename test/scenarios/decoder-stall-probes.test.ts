import t from 'tap'
import { needNixl, probeNixl } from '../native/helpers.js'
import { metric, within } from '../helpers/pd-agents.js'
import { instance, report, stallCluster, stallTraffic } from '../helpers/decoder-stall.js'

/*
 * Issue 17 item 1, the probes: a decoder whose engine freezes for 2.2 s (SIGSTOP of the
 * engine, its agent still running) is marked down by the router's probes (every 200 ms, two
 * failures). Being out of routing is not being gone: the router must not end the leases it
 * handed that decoder, or P reuses the blocks (LIFO) and the decoder, resuming well inside
 * P's lease, passes its own lease check and decodes another request's KV. Before the fix
 * this printed wrong text for a held request; now the held requests finish with the
 * oracle's text and the decoder serves again once its probes pass.
 */

const probe = await probeNixl()

t.test('engine freeze: probes mark the decoder down, its held requests still decode their own KV', { skip: needNixl(t, probe) }, async (t) => {
  const c = await stallCluster(t)
  let markedDown = -1
  const run = await stallTraffic(c, {
    tag: 'freeze',
    stallMs: 2200,
    totalMs: 4500,
    during: async () => {
      markedDown = await within(2000, async () => (await instance(c.router.url, c.stalledId))?.state === 'unhealthy')
    },
  })
  const s = report(t, 'engine freeze 2.2 s, probes on', run.outcomes)
  t.ok(s.requests >= 30, `at least 30 requests (${s.requests})`)
  t.ok(markedDown >= 0, 'the probes marked the frozen decoder down')
  t.ok(run.heldOnStalled >= 1, `requests were held on the frozen decoder (${run.heldOnStalled})`)
  t.equal(s.wrong, 0, 'no client got another request’s text')
  t.equal(s.failed, 0, 'the stall stayed inside the lease: every request succeeded')
  t.equal(await metric(c.router.url, 'handoff_router_leases_released_total'), 0, 'the router released no lease')
  const back = await within(5000, async () => (await instance(c.router.url, c.stalledId))?.state === 'ready')
  t.ok(back >= 0, 'the decoder is back in routing once its probes pass')
})
