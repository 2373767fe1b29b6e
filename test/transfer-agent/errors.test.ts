import { readFileSync } from 'node:fs'
import { join } from 'node:path'
import t from 'tap'
import { duplicateCodes, errorCodes } from '../../common/coded-error.js'
import { packageRoot } from '../../common/paths.js'
import { nativeErrors } from '../../native/errors.js'
import { routerErrors } from '../../router/src/errors.js'
import { simErrors } from '../../sim/src/errors.js'
import { XFA_ERR_PEER_GONE, isXfaError, xfaError, xfaErrors } from '../../transfer-agent/src/errors.js'

const docs = readFileSync(join(packageRoot, 'docs', 'errors.md'), 'utf8')

// The same check test/common/errors.test.ts makes for router, sim and native, for this table.
t.test('the transfer-agent table: codes unique across packages, each documented once with its status', async (t) => {
  const codes = errorCodes(xfaErrors)
  t.ok(codes.length >= 4)
  for (const code of ['XFA_ERR_PEER_GONE', 'XFA_ERR_HANDSHAKE_FAILED', 'XFA_ERR_ENGINE_ID_MISMATCH', 'XFA_ERR_KV_EXPIRED']) {
    t.ok(codes.includes(code), `${code} exists`)
  }
  t.same(duplicateCodes(xfaErrors, routerErrors, simErrors, nativeErrors), [], 'no code in two tables')
  const start = docs.indexOf('## transfer-agent (XFA_ERR_*)')
  t.ok(start >= 0, 'docs/errors.md has the section')
  const next = docs.indexOf('\n## ', start + 1)
  const section = docs.slice(start, next < 0 ? undefined : next)
  for (const [name, ctor] of Object.entries(xfaErrors)) {
    t.match(name, /^XFA_ERR_[A-Z_]+$/)
    t.equal(ctor.code, name, `the export name is the code (${name})`)
    t.equal([...docs.matchAll(new RegExp(`^\\| \`${name}\` \\|`, 'gm'))].length, 1, `${name} has one row in docs/errors.md`)
    t.match(section, `| \`${name}\` | ${ctor.spec.status} |`, `${name} documented with ${ctor.spec.status}`)
  }
  const documented = [...section.matchAll(/`(XFA_ERR_[A-Z_]+)`/g)].map((m) => m[1])
  t.same([...new Set(documented)].filter((c) => !codes.includes(c as string)), [], 'the docs list no unknown code')
})

t.test('xfaError attaches peer details and the cause', async (t) => {
  const cause = new Error('ECONNREFUSED')
  const e = xfaError('XFA_ERR_HANDSHAKE_FAILED', 'p0 at h:1', { engineId: 'p0', address: 'h:1', cause })
  t.same([e.code, e.statusCode, e.message, e.engineId, e.address, e.cause], ['XFA_ERR_HANDSHAKE_FAILED', 502, 'handshake failed: p0 at h:1', 'p0', 'h:1', cause])
  const g = xfaError('XFA_ERR_PEER_GONE', 'p1')
  t.ok(g instanceof XFA_ERR_PEER_GONE)
  t.same([g.statusCode, g.engineId, g.address, g.cause], [410, undefined, undefined, undefined])
  t.ok(isXfaError(g))
  t.notOk(isXfaError(Object.assign(new Error('x'), { code: 'XFA_ERR_PEER_GONE' })))
})
