import t from 'tap'
import { get, post, spawnRouter, waitFor } from '../helpers/cluster.js'
import { ghost } from '../helpers/event-log.js'
import { needRedis, startRedis } from '../helpers/redis.js'

/*
 * Issue 21 item 4: a 202 names what it logged. Redis restarted empty takes the event log with
 * it, and the router starts a new one whose sequences begin at 1 again: "seq 1" then names
 * another event. The ops answer and GET /fault_tolerance/events/:seq carry the log id and the
 * engine_ids, and a sequence asked for with the log it came from is refused once that log is
 * gone, instead of answered for the new log's event. A router process on a real redis-server.
 */
const ADMIN = 'admin-token-event-log-id'
const admin = { authorization: `Bearer ${ADMIN}` }
type Accepted = { seq: number; log_id: string; engine_ids: string[] }

t.test('an ops event named by its log: once Redis lost that log, asking for it says so', { skip: needRedis(t) }, async (t) => {
  const redis = await startRedis(t)
  const router = await spawnRouter(t, { adminToken: ADMIN, store: { kind: 'redis', url: redis.url } })
  /** Declares a throwaway engine gone; undefined when the router refused (Redis away: 503). */
  const declare = async (name: string): Promise<Accepted | undefined> => {
    await ghost(router.url, name, 5901)
    const res = await post(`${router.url}/fault_tolerance/event`, { event_type: 'peer_gone', nodes: { engine_ids: [`ghost-${name}`] } }, admin)
    return res.status === 202 ? res.json<Accepted>() : undefined
  }
  const first = (await declare('one')) as Accepted
  t.ok(first, 'the router logged it')
  t.match(first, { seq: 1, log_id: /^[0-9a-f-]{36}$/, engine_ids: ['ghost-one'] }, 'the 202 names the log and the engine')
  const asked = (seq: number, log: string) => get(`${router.url}/fault_tolerance/events/${seq}?log=${log}`, admin)
  t.match((await asked(first.seq, first.log_id)).json(), { seq: 1, log_id: first.log_id, type: 'peer_gone', engine_ids: ['ghost-one'] })

  // Redis comes back empty: the router starts a new log, and its first event is seq 1 again.
  await redis.stop()
  await redis.start()
  let second: Accepted | undefined
  const answers: Accepted[] = []
  t.ok(
    await waitFor(async () => {
      second = await declare('two').catch(() => undefined)
      if (second) answers.push(second)
      return second !== undefined && second.log_id !== first.log_id
    }, 15_000),
    'a new log once Redis is back empty',
  )
  // Each 202 must name the log its event is in: asked for with that log, the event is there.
  const misnamed: Accepted[] = []
  for (const a of answers) {
    const res = await asked(a.seq, a.log_id)
    if (res.status !== 200 || !res.json<{ engine_ids: string[] }>().engine_ids.includes('ghost-two')) misnamed.push(a)
  }
  t.comment(`${answers.length} answers after Redis came back empty; misnamed: ${JSON.stringify(misnamed)}`)
  t.equal(misnamed.length, 0, 'every 202 named the log its event is in')
  // The router logged ghost-one again in the new log (nobody acknowledged it: no agent
  // follows here), so an agent that joins still learns it is gone; ghost-two comes after it.
  t.match(second, { seq: 2, engine_ids: ['ghost-two'] }, 'the new log starts over: ghost-one again, then ghost-two')
  const old = await asked(first.seq, first.log_id)
  t.equal(old.status, 410, 'seq 1 of the old log: refused')
  t.equal(old.json<{ error: { code: string } }>().error.code, 'RTR_ERR_EVENT_OTHER_LOG')
  t.match((await asked(1, second?.log_id ?? '')).json(), { engine_ids: ['ghost-one'] }, 'seq 1 of the new log is ghost-one, logged again')
})
