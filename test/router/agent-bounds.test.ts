import t from 'tap'
import { BoundedSet } from '../../router/src/events/bounded-set.js'
import { loadConfig } from '../../router/src/config.js'
import { post, startRouter, waitFor } from '../helpers/cluster.js'
import { needRedis, startRedis } from '../helpers/redis.js'

// Issue 18 item 3: the agent directory is a collection a caller grows (POST /v1/agents), so
// it has a bound: limits.maxAgents. A registration that would add a record past it is
// refused, coded; a known agent registering again, or a new agent replacing the one at its
// address, never grows it and is always taken.

const agent = (id: string, host: string, engineId = `${id}-engine`) => ({ agentId: id, engineId, role: 'decode', agentUrl: `http://${host}:7600` })
const limits = (maxAgents: number) => ({ ...loadConfig({ overrides: {} }).limits, maxAgents })

t.test('the directory takes limits.maxAgents agents, then refuses new ones with a code', async (t) => {
  const { url, app } = await startRouter(t, [], { probe: false, limits: limits(3) })
  for (const i of [1, 2, 3]) t.equal((await post(`${url}/v1/agents`, agent(`a${i}`, `10.0.0.${i}`))).status, 200)
  const full = await post(`${url}/v1/agents`, agent('a4', '10.0.0.4'))
  t.equal(full.status, 503)
  t.match(full.json(), { error: { code: 'RTR_ERR_TOO_MANY_AGENTS', message: /limits\.maxAgents \(3\)/ } })
  t.equal(app.events.agents.size, 3)
  // Known agents are always taken, whatever they changed.
  for (let k = 0; k < 20; k++) t.equal((await post(`${url}/v1/agents`, agent('a1', '10.0.0.1', `a1-engine-${k}`))).status, 200)
  t.equal((await post(`${url}/v1/agents`, agent('a2', '10.0.0.2'))).status, 200, 'the same registration again')
  // A new agent at a known agent's address replaces it (its process restarted): no growth.
  t.equal((await post(`${url}/v1/agents`, agent('a3-restarted', '10.0.0.3'))).status, 200)
  t.equal(app.events.agents.size, 3)
  t.notOk(app.events.agents.get('a3'), 'the one it replaced is gone')
  t.equal((await post(`${url}/v1/agents`, agent('a4', '10.0.0.4'))).status, 503, 'still full')
})

t.test('engine_ids remembered as seen are bounded too (re-registrations under new ones)', async (t) => {
  const seen = new BoundedSet<string>(3)
  for (const id of ['a', 'b', 'c', 'a', 'd']) seen.add(id)
  t.same([...seen], ['c', 'a', 'd'], 'the oldest go first; adding one again makes it the newest')
  t.ok(seen.has('a'))
  t.notOk(seen.has('b'))
  t.equal(seen.size, 3)
  t.throws(() => new BoundedSet(0), RangeError)
})

t.test('with the Redis store: every router counts the agents the others took', { skip: needRedis(t) }, async (t) => {
  const redis = await startRedis(t)
  const store = { ...loadConfig({ overrides: {} }).store, kind: 'redis' as const, url: redis.url }
  const a = await startRouter(t, [], { probe: false, store, limits: limits(2) })
  const b = await startRouter(t, [], { probe: false, store, limits: limits(2) })
  t.equal((await post(`${a.url}/v1/agents`, agent('r1', '10.0.1.1'))).status, 200)
  t.equal((await post(`${a.url}/v1/agents`, agent('r2', '10.0.1.2'))).status, 200)
  await waitFor(() => b.app.events.agents.size === 2, 5000)
  t.match((await post(`${b.url}/v1/agents`, agent('r3', '10.0.1.3'))).json(), { error: { code: 'RTR_ERR_TOO_MANY_AGENTS' } })
  t.equal((await post(`${b.url}/v1/agents`, agent('r1', '10.0.1.1', 'r1-new'))).status, 200, "another router's agent registering here is known")
})
