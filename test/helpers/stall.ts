import type { Test } from 'tap'
import { complete, completionBody, metric, sleep, tally, type Engine, type Outcome } from './pd-agents.js'

/*
 * Timed traffic for the scenarios (test/scenarios/): requests through the router while steps
 * stop and continue processes; the stale-read scenarios' run (stallRun) stops the decoders'
 * agents (SIGSTOP) for longer or shorter than a lease.
 */

/** P's lease in these scenarios: a 10 s stop outlives it, a 2 s stop does not. */
export const LEASE_S = 5

export interface Run {
  stopMs: number
  decoders: Engine[]
  outcomes: Outcome[]
}

/** Traffic every 150 ms for the whole run; the decoders' agents stopped from 1 s for `stopMs` (timedRun). */
export async function stallRun(url: string, decoders: Engine[], stopMs: number, tag: string): Promise<Run> {
  const signal = (sig: NodeJS.Signals) => (): void => {
    for (const d of decoders) d.agent.child.kill(sig)
  }
  const outcomes = await timedRun(
    url,
    { totalMs: 1000 + stopMs + 1500, everyMs: 150, burst: 1, steps: [[1000, signal('SIGSTOP')], [1000 + stopMs, signal('SIGCONT')]], finally: signal('SIGCONT') },
    tag,
  )
  return { stopMs, decoders, outcomes }
}

export function report(t: Test, name: string, outcomes: readonly Outcome[]): ReturnType<typeof tally> {
  const s = tally(outcomes)
  t.comment(`${name}: ${s.requests} requests, ${s.ok} oracle text, ${s.wrong} wrong text, ${s.failed} failed ${JSON.stringify(s.codes)}`)
  return s
}

/** Something a timed run does at `atMs` from its start (stop a process, hold a hop, ...). */
export type Step = readonly [atMs: number, act: () => void]

/**
 * `burst` requests every `everyMs` for `totalMs`, with `steps` done at their times; resolves
 * with every outcome once all have answered. `finally` runs at the end whatever happened
 * (continue what a step stopped).
 */
export async function timedRun(url: string, opts: { totalMs: number; everyMs: number; burst: number; steps: Step[]; finally?: () => void }, tag: string): Promise<Outcome[]> {
  const pending: Promise<Outcome>[] = []
  const steps = [...opts.steps].sort((a, b) => a[0] - b[0])
  const started = performance.now()
  try {
    for (let n = 0; performance.now() - started < opts.totalMs; ) {
      for (let b = 0; b < opts.burst; b++, n++) pending.push(complete(url, completionBody(n, tag), n, 90_000))
      while (steps.length > 0 && performance.now() - started >= steps[0]![0]) steps.shift()![1]()
      await sleep(opts.everyMs)
    }
    for (const [, act] of steps) act()
  } finally {
    opts.finally?.()
  }
  return Promise.all(pending)
}

/**
 * No wrong text among enough answers, and the router did catch late reads (lapsed, late or
 * unproven): the scenario made some, so a window that let them through would show.
 */
export async function noWrongText(t: Test, name: string, outcomes: Outcome[], routerUrl: string): Promise<void> {
  const s = report(t, name, outcomes)
  t.comment(`wrong text: ${s.wrong} of ${s.requests}`)
  t.ok(s.requests >= 30, 'enough requests to see it')
  t.equal(s.wrong, 0, 'no client got another request’s text')
  const caught = await Promise.all([
    metric(routerUrl, 'handoff_router_late_reads_total'),
    metric(routerUrl, 'handoff_router_unproven_reads_total'),
    metric(routerUrl, 'handoff_router_leases_lapsed_total', { when: 'before_dispatch' }),
  ])
  t.ok(caught.reduce((a, b) => a + b) > 0, `the router caught late reads (late, unproven, lapsed: ${caught.join(', ')})`)
  // Every engine of these cases lives through them (stopped, paused or slow, never gone).
  const gone = await metric(routerUrl, 'handoff_router_events_total', { type: 'peer_gone' })
  t.comment(`healthy engines declared gone: ${gone}`)
  t.equal(gone, 0, 'no live engine declared gone')
}
