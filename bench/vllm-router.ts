import { spawn } from 'node:child_process'
import { existsSync } from 'node:fs'
import { join } from 'node:path'
import { setTimeout as sleep } from 'node:timers/promises'
import { request } from 'undici'
import { packageRoot } from '../common/paths.js'
import { freePort } from '../common/ports.js'

/*
 * The anchor of the router benches (issue 23 item 4): vLLM Router (Rust; PyPI `vllm-router`),
 * the strongest P/D router there is, over the same simulators in the same run.
 * scripts/vllm-router.sh installs it in .cache/vllm-router/venv; a bench runs it when it is
 * there (or where --vllm-router says) and says so when it is not.
 */

/** Where scripts/vllm-router.sh installs it. */
export const VLLM_ROUTER_BIN = join(packageRoot, '.cache/vllm-router/venv/bin/vllm-router')

/** The binary to run: `given` (which must exist), else the installed one, else none. */
export function vllmRouterBin(given?: string): string | undefined {
  if (given !== undefined) {
    if (!existsSync(given)) throw new Error(`--vllm-router ${given}: no such file`)
    return given
  }
  return existsSync(VLLM_ROUTER_BIN) ? VLLM_ROUTER_BIN : undefined
}

export interface ExternalRouter {
  url: string
  pid: number
  stop(): Promise<void>
}

/**
 * `vllm-router --vllm-pd-disaggregation --prefill P --decode D` on loopback, as its README
 * starts it, with its retries and circuit breaker left at their defaults (what a new user
 * gets). Resolves once it answers /health; rejects with its output otherwise.
 */
export async function startVllmRouter(bin: string, prefill: string, decode: string): Promise<ExternalRouter> {
  const [port, metricsPort] = [await freePort(), await freePort()]
  const args = ['--vllm-pd-disaggregation', '--prefill', prefill, '--decode', decode, '--host', '127.0.0.1', '--port', String(port)]
  args.push('--prometheus-host', '127.0.0.1', '--prometheus-port', String(metricsPort), '--log-level', 'warning')
  const child = spawn(bin, args, { stdio: ['ignore', 'pipe', 'pipe'] })
  let output = ''
  const keep = (b: Buffer): void => {
    output = (output + b.toString('utf8')).slice(-4000)
  }
  child.stdout.on('data', keep)
  child.stderr.on('data', keep)
  let exited = false
  child.once('exit', () => (exited = true))
  const stop = async (): Promise<void> => {
    if (exited) return
    child.kill('SIGTERM')
    for (let i = 0; i < 50 && !exited; i++) await sleep(100)
    if (!exited) child.kill('SIGKILL')
  }
  const url = `http://127.0.0.1:${port}`
  for (const deadline = performance.now() + 60_000; performance.now() < deadline; await sleep(200)) {
    if (exited) throw new Error(`vllm-router exited before it served:\n${output}`)
    const up = await request(`${url}/health`, { headersTimeout: 1000, bodyTimeout: 1000 })
      .then(async (r) => {
        await r.body.dump()
        return r.statusCode === 200
      })
      .catch(() => false)
    if (up) return { url, pid: child.pid as number, stop }
  }
  await stop()
  throw new Error(`vllm-router did not answer /health within 60 s:\n${output}`)
}
