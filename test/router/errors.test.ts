import { readFileSync } from 'node:fs'
import { join } from 'node:path'
import t from 'tap'
import { packageRoot } from '../../common/paths.js'
import * as errors from '../../router/src/errors.js'

const docs = readFileSync(join(packageRoot, 'docs', 'errors.md'), 'utf8')

t.test('every router error code is exported, unique, coded and documented', async (t) => {
  const codes = Object.keys(errors.errorSpecs)
  t.ok(codes.length > 0)
  for (const code of codes) {
    t.match(code, /^RTR_ERR_[A-Z_]+$/)
    const ctor = (errors as unknown as Record<string, (new (...a: unknown[]) => errors.CodedError) | undefined>)[code]
    t.type(ctor, 'function', `${code} is exported`)
    if (!ctor) continue
    const e = new ctor('a', 'b', 'c', 'd')
    t.equal(e.code, code)
    t.equal(e.statusCode, errors.errorSpecs[code as errors.RouterErrorCode].status)
    t.ok(errors.isRouterError(e))
    t.match(docs, new RegExp(`\\| \`${code}\` \\| ${e.statusCode} \\|`), `${code} is in docs/errors.md with its status`)
  }
  const documented = [...docs.matchAll(/`(RTR_ERR_[A-Z_]+)`/g)].map((m) => m[1])
  t.same([...new Set(documented)].filter((c) => !codes.includes(c as string)), [], 'docs list no unknown code')
})

t.test('error bodies and stream events have the OpenAI shape', async (t) => {
  const e = new errors.RTR_ERR_UPSTREAM_RESET('decode', 'd0', { cause: new Error('socket') })
  t.same(errors.errorBody(e), {
    error: { message: 'decode instance d0 closed the connection', type: 'upstream_error', param: null, code: 'RTR_ERR_UPSTREAM_RESET' },
  })
  t.equal((e as Error).cause instanceof Error, true)
  const ev = errors.errorEvent(e)
  t.match(ev, /^data: \{"error":/)
  t.ok(ev.endsWith('data: [DONE]\n\n'))
  t.notOk(errors.isRouterError(new Error('plain')))
})
