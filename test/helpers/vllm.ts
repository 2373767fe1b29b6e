import { existsSync } from 'node:fs'
import { join } from 'node:path'
import { VllmEngine, VLLM_VERSION, vllmDir, type VllmOptions } from '../../bench/vllm-engine.js'
import { post, type Posted, type Teardown } from './cluster.js'
import { missing } from './need.js'

export { MODEL, VllmEngine, VLLM_VERSION } from '../../bench/vllm-engine.js'

/*
 * Real vLLM engines for tests (issue 19), from bench/vllm-engine.ts. A test file starts its
 * engines once and shares them across its cases; .taprc lists test/vllm/ as serial, so no two
 * such files run at once and nothing else runs beside them.
 */

/**
 * tap's `skip` for tests that need real vLLM: the reason (with the command that installs it)
 * when it is missing, false when it is there. Under CI a missing install is a failure.
 */
export function needVllm(t: { fail(message: string): void }): string | false {
  if (existsSync(join(vllmDir, '.ready'))) return false
  return missing(t, `real vLLM ${VLLM_VERSION} not installed in ${vllmDir}: run scripts/vllm-tools.sh (about 1 min with a fast link, 6 GB)`)
}

/** Starts engines side by side (each start is mostly waiting on one core); stopped when the test ends. */
export async function startVllm(t: Teardown, opts: VllmOptions[]): Promise<VllmEngine[]> {
  return Promise.all(opts.map((o) => VllmEngine.start(o, (stop) => t.teardown(stop))))
}

/** One answer, read whole. */
export type Answer = Posted

/** POSTs `body` to `url` + `path` and reads the answer whole; a real engine may take 120 s. */
export function call(url: string, path: string, body: unknown, headers: Record<string, string> = {}): Promise<Answer> {
  return post(`${url}${path}`, body, headers, 120_000)
}

export interface Choice {
  index: number
  text?: string
  message?: { content?: string }
  finish_reason?: string
  logprobs?: unknown
}

/** The router's (or an engine's) error code in a JSON error answer. */
export const errorCode = (a: Answer): string | undefined => {
  try {
    return a.json<{ error?: { code?: string } }>().error?.code
  } catch {
    return undefined
  }
}
export const isLateRead = (a: Answer): boolean => errorCode(a) === 'RTR_ERR_LATE_READ'

/** The choices' texts (or messages), by index. */
export const texts = (a: Answer): string[] => a.json<{ choices: Choice[] }>().choices.sort((x, y) => x.index - y.index).map((c) => c.text ?? c.message?.content ?? '')

