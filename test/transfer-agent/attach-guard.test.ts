import t from 'tap'
import { attach, region, skipWithoutNixl, startAgent, waitEvent, type Layout } from './agent-procs.js'

// Which shared-memory objects an agent maps (issue 18 §4): only names under its prefix, and
// never a region another agent has attached: mapping it would let this agent's peers read
// another engine's KV and write into its blocks. A refused attach changes nothing: the engine
// attached before keeps its region and its leases. Real agent processes; runs dist/.

const skip = await skipWithoutNixl(t)
const layout: Layout = { blockSize: 16, bytesPerToken: 32, numBlocks: 16 }

t.test('attach maps only the engine’s own region', { skip }, async (t) => {
  const [A, B] = await Promise.all([startAgent(t), startAgent(t)])
  const ra = region(t, 'guard-a', layout)
  const rb = region(t, 'guard-b', layout)
  const engineA = `guard-a-${process.pid}`
  await Promise.all([attach(A, engineA, 'prefill', ra, layout), attach(B, `guard-b-${process.pid}`, 'prefill', rb, layout)])
  t.equal((await A.call('POST', '/v1/leases', { requestId: 'held', blockIds: [1, 2] })).status, 201, 'A holds a lease')

  const attachAs = (engineId: string, shmName: string) => A.call('POST', '/v1/engine/attach', { engineId, role: 'prefill', shmName, ...layout })
  const stillHeld = async (what: string) => {
    const status = await A.call<{ engineId?: string; leases?: number }>('GET', '/v1/status')
    t.match(status.body, { engineId: engineA, leases: 1 }, `${what}: A still serves its engine and holds its lease`)
  }

  await t.test('a name outside the prefix is refused', async (t) => {
    const outside = region(t, 'outside', layout, '/xfa-outside-')
    const res = await attachAs(`evil-${process.pid}`, outside.name)
    t.match(res, { status: 403, body: { error: { code: 'XFA_ERR_ATTACH_REFUSED' } } })
    t.match(String((res.body as { error?: { message?: string } }).error?.message), /\/handoff-/, 'the message names the prefix')
    await stillHeld('outside the prefix')
  })

  await t.test("another agent's region is refused", async (t) => {
    const res = await attachAs(`thief-${process.pid}`, rb.name)
    t.match(res, { status: 409, body: { error: { code: 'XFA_ERR_REGION_IN_USE' } } })
    await stillHeld('region of agent B')
    t.match((await B.call('GET', '/v1/status')).body, { engineId: `guard-b-${process.pid}` }, 'B keeps its region')
  })

  await t.test('a restarted engine (new engine_id, same region name) is still taken', async (t) => {
    const res = await attachAs(`${engineA}-2`, ra.name)
    t.equal(res.status, 200)
    t.ok(await waitEvent(A, (e) => e.type === 'lease_ended' && e.requestId === 'held', 2_000), 'the old incarnation’s lease ends')
    t.match((await A.call('GET', '/v1/status')).body, { engineId: `${engineA}-2`, leases: 0 })
  })

  await t.test('once B lets go of its region, A may take it', async (t) => {
    await B.stop()
    const res = await attachAs(`guard-b-${process.pid}-2`, rb.name)
    t.equal(res.status, 200, JSON.stringify(res.body))
  })
})
