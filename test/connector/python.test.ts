import t from 'tap'
import { spawn } from 'node:child_process'
import { join } from 'node:path'
import { vllmDir } from '../../bench/vllm-engine.js'
import { needVllm } from '../helpers/vllm.js'

/*
 * handoff's vLLM connector's Python tests (transfer-agent/vllm/tests, stdlib unittest): with
 * the system python3 the ones that need no vLLM (inbox, settings, frames); with the vLLM venv
 * of scripts/vllm-tools.sh all of them, the scheduler side inside vLLM 0.32's own Scheduler
 * included.
 */
const cwd = new URL('../../transfer-agent/vllm/', import.meta.url).pathname

async function unittest(python: string, env: NodeJS.ProcessEnv = process.env): Promise<{ code: number | null; out: string }> {
  const child = spawn(python, ['-m', 'unittest', 'discover', '-s', 'tests', '-t', '.', '-v'], { cwd, env })
  let out = ''
  child.stdout.on('data', (d: Buffer) => (out += d.toString()))
  child.stderr.on('data', (d: Buffer) => (out += d.toString()))
  const code = await new Promise<number | null>((resolve) => child.once('exit', resolve))
  return { code, out }
}

const ran = (out: string): number => Number(/Ran (\d+) tests?/.exec(out)?.[1] ?? 0)
const skipped = (out: string): number => Number(/skipped=(\d+)/.exec(out)?.[1] ?? 0)

t.test('without vLLM (system python3): the inbox, settings and frames', async (t) => {
  const { code, out } = await unittest('python3')
  t.equal(code, 0, 'python3 -m unittest passes', { out: out.slice(-3000) })
  t.ok(ran(out) - skipped(out) >= 9, `${ran(out) - skipped(out)} ran, ${skipped(out)} skipped (they need vLLM)`)
})

t.test('with vLLM 0.32: the scheduler side inside vLLM’s own Scheduler, and the version check', { skip: needVllm(t) }, async (t) => {
  const { code, out } = await unittest(join(vllmDir, 'venv/bin/python'), { ...process.env, HANDOFF_TINY_MODEL: join(vllmDir, 'tiny-llama') })
  t.equal(code, 0, 'the vLLM venv runs them all', { out: out.slice(-4000) })
  t.equal(skipped(out), 0, 'none skipped')
  t.ok(ran(out) >= 13, `${ran(out)} ran, the ${ran(out) - 9} that need vLLM among them`)
})
