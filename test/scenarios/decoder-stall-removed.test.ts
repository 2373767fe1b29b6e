import t from 'tap'
import { request } from 'undici'
import { needNixl, probeNixl } from '../native/helpers.js'
import { metric } from '../helpers/pd-agents.js'
import { admin, report, stallCluster, stallTraffic } from '../helpers/decoder-stall.js'

/*
 * Issue 17 item 1, by hand: an operator deletes (or drains) a decoder whose engine is frozen
 * while it holds requests. Its leases stay P's: the router hands out no early release on its
 * own inference, so the held requests, resuming inside P's lease, decode their own KV. Before
 * the fix a DELETE released them and the held requests answered 200 with another prompt's text.
 */

const probe = await probeNixl()

for (const how of ['delete', 'drain'] as const) {
  t.test(`${how} a frozen decoder that holds requests: no stale read`, { skip: needNixl(t, probe) }, async (t) => {
    const c = await stallCluster(t, 'lenient')
    let status = 0
    const run = await stallTraffic(c, {
      tag: how,
      stallMs: 2200,
      totalMs: 4500,
      during: async () => {
        const res =
          how === 'delete'
            ? await request(`${c.router.url}/admin/instances/${c.stalledId}`, { method: 'DELETE', headers: admin })
            : await request(`${c.router.url}/admin/instances/${c.stalledId}/drain`, { method: 'POST', headers: { ...admin, 'content-type': 'application/json' }, body: '{}' })
        status = res.statusCode
        await res.body.dump()
      },
    })
    const s = report(t, `${how} of a decoder frozen for 2.2 s`, run.outcomes)
    t.ok(s.requests >= 30, `at least 30 requests (${s.requests})`)
    t.equal(status, how === 'delete' ? 200 : 202, `the ${how} was accepted`)
    t.ok(run.heldOnStalled >= 1, `requests were held on the frozen decoder (${run.heldOnStalled})`)
    t.equal(s.wrong, 0, 'no client got another request’s text')
    t.equal(s.failed, 0, 'the held requests finished inside the lease')
    t.equal(await metric(c.router.url, 'handoff_router_leases_released_total'), 0, 'the router released no lease')
  })
}
