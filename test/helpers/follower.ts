import { spawn } from 'node:child_process'
import { createInterface } from 'node:readline'
import type { Teardown } from './cluster.js'

/*
 * The vLLM connector's router follower (transfer-agent/vllm/handoff_vllm/follower.py) as a
 * real Python process without vLLM (tests/follow_router.py): it registers with the routers
 * as a decoder's `vllm-connector`, prints each event as a JSON line, and acknowledges it.
 */
const SCRIPT = new URL('../../transfer-agent/vllm/tests/follow_router.py', import.meta.url).pathname

export type FollowerLine = { started?: boolean; new_log?: boolean; event?: { seq: number; type: string; engineIds?: string[]; goneEngineIds?: string[] } }

export interface Follower {
  readonly lines: FollowerLine[]
  /** The sequences of the events it printed, in order. */
  seqs(): number[]
  stderr(): string
}

/**
 * Starts one following `routers` in turn, as engine `engineId` (its agent id is
 * `vllm-<engineId>`); killed when the test ends. Followers side by side need agent URLs of
 * their own (the router takes one at an address another held as its restart).
 */
export function startFollower(t: Teardown, opts: { engineId: string; routers: string[]; token: string; agentUrl?: string }): Follower {
  const args = [SCRIPT, '--engine-id', opts.engineId, '--role', 'decode', '--agent-url', opts.agentUrl ?? 'http://127.0.0.1:5601', '--engine-url', 'http://127.0.0.1:10']
  for (const url of opts.routers) args.push('--router', url)
  const child = spawn('python3', args, { env: { ...process.env, HANDOFF_AGENT_TOKEN: opts.token }, stdio: ['pipe', 'pipe', 'pipe'] })
  let stderr = ''
  child.stderr.on('data', (d: Buffer) => (stderr += d.toString()))
  t.teardown(() => {
    child.stdin.end()
    child.kill('SIGKILL')
  })
  const lines: FollowerLine[] = []
  createInterface({ input: child.stdout }).on('line', (l) => lines.push(JSON.parse(l) as FollowerLine))
  return { lines, seqs: () => lines.flatMap((l) => (l.event ? [l.event.seq] : [])), stderr: () => stderr }
}
