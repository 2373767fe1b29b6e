import { readFileSync } from 'node:fs'
import { join } from 'node:path'
import t from 'tap'
import { codedErrors, codedErrorsWith, duplicateCodes, errorCodes, errorWithDetails, isTableError } from '../../common/coded-error.js'
import { packageRoot } from '../../common/paths.js'
import { simErrors } from '../../sim/src/errors.js'

const docs = readFileSync(join(packageRoot, 'docs', 'errors.md'), 'utf8')

t.test('codedErrors builds @fastify/error constructors named by their codes', async (t) => {
  const specs = {
    DEMO_ERR_UPSTREAM: { status: 502, message: '%s instance %s failed', type: 'upstream_error' },
    DEMO_ERR_PLAIN: { status: 400, message: 'plain' },
  } as const
  const table = codedErrors(specs)
  t.same(errorCodes(table), ['DEMO_ERR_UPSTREAM', 'DEMO_ERR_PLAIN'])
  t.ok(Object.isFrozen(table))
  const cause = new Error('socket')
  const e = new table.DEMO_ERR_UPSTREAM('decode', 'd0', { cause })
  t.equal(e.code, 'DEMO_ERR_UPSTREAM')
  t.equal(e.statusCode, 502)
  t.equal(e.message, 'decode instance d0 failed')
  t.equal(e.cause, cause, 'a last {cause} argument chains the cause')
  t.equal(e.type, 'upstream_error', 'extra spec fields are on the instance')
  t.notOk(Object.keys(e).includes('type'), '… but not enumerable')
  t.ok(e instanceof Error && e instanceof table.DEMO_ERR_UPSTREAM)
  t.notOk(e instanceof table.DEMO_ERR_PLAIN)
  t.equal(table.DEMO_ERR_UPSTREAM.code, 'DEMO_ERR_UPSTREAM')
  t.same(table.DEMO_ERR_UPSTREAM.spec, specs.DEMO_ERR_UPSTREAM)
  t.equal(table.DEMO_ERR_PLAIN().code, 'DEMO_ERR_PLAIN', 'callable without new, as @fastify/error allows')
  t.ok(isTableError(table, e))
  t.notOk(isTableError(table, new Error('x')))
  t.notOk(isTableError(table, Object.assign(new Error('x'), { code: 'DEMO_ERR_PLAIN' })), 'a look-alike is not one of ours')
  t.notOk(isTableError(table, 'DEMO_ERR_PLAIN'))

  // Native-style arguments: (detail, {cause}), typed through the second type parameter.
  const nat = codedErrorsWith<[detail: string, options?: { cause?: unknown }]>()({
    NAT_DEMO: { status: 503, message: 'NIXL not available: %s' },
  })
  // @ts-expect-error the arguments are typed: a number is not a detail string
  t.ok(nat.NAT_DEMO(5))
  const n = new nat.NAT_DEMO('dlopen failed', { cause: 'ENOENT' })
  t.same([n.message, n.cause, n.statusCode], ['NIXL not available: dlopen failed', 'ENOENT', 503])

  t.throws(() => codedErrors({ lower_case: { status: 400, message: 'x' } }), TypeError)
  t.throws(() => codedErrors({ DEMO_X: { status: 4.5, message: 'x' } }), TypeError)
  t.throws(() => codedErrors({ DEMO_X: { status: 400, message: 'x', code: 'other' } }), /reserved/)
  t.same(duplicateCodes(table, codedErrors({ DEMO_ERR_PLAIN: { status: 400, message: 'again' } }), simErrors), ['DEMO_ERR_PLAIN'])
  t.same(duplicateCodes(table, simErrors), [])
})

t.test('errorWithDetails: the coded error with its defined context fields and cause', async (t) => {
  const table = codedErrorsWith<[detail: string, options?: { cause?: unknown }]>()({ DEMO_ERR_PEER: { status: 502, message: 'peer %s' } })
  t.ok(isTableError(table, new table.DEMO_ERR_PEER('x')), 'a table with typed arguments fits isTableError too')
  const cause = new Error('socket')
  const e = errorWithDetails(table, 'DEMO_ERR_PEER', 'p0', { engineId: 'e1', address: undefined, cause })
  t.equal(e.message, 'peer p0')
  t.equal(e.engineId, 'e1')
  t.notOk('address' in e, 'undefined fields are left off')
  t.equal(e.cause, cause)
  t.notOk('cause' in errorWithDetails(table, 'DEMO_ERR_PEER', 'p0', {}), 'no cause without one')
  t.throws(() => errorWithDetails(table, 'DEMO_ERR_NOPE', 'x', {}), TypeError)
})

t.test('the simulator table: codes unique, prefixed, documented with their status', async (t) => {
  const codes = errorCodes(simErrors)
  t.ok(codes.length > 0)
  t.equal(new Set(codes).size, codes.length)
  const section = docs.slice(docs.indexOf('## sim'), docs.indexOf('\n## ', docs.indexOf('## sim') + 1))
  for (const code of codes) {
    t.match(code, /^SIM_ERR_[A-Z_]+$/)
    const ctor = simErrors[code as keyof typeof simErrors]
    const e = new ctor('a', 'b', 'c')
    t.equal(e.code, code)
    // Configuration errors end the process (exit 2) and are documented that way.
    const status = code === 'SIM_ERR_INVALID_CONFIG' || code === 'SIM_ERR_KV_MODE_UNSUPPORTED' ? 'exit 2' : String(e.statusCode)
    t.match(section, `| \`${code}\` | ${status} |`, `${code} documented with ${status}`)
  }
  const documented = [...section.matchAll(/`(SIM_ERR_[A-Z_]+)`/g)].map((m) => m[1])
  t.same([...new Set(documented)].filter((c) => !codes.includes(c as string)), [], 'the docs list no unknown sim code')
})

t.test('one consistency check over every package: codes unique across tables, each documented once', async (t) => {
  const { routerErrors } = await import('../../router/src/errors.js')
  const { nativeErrors } = await import('../../native/errors.js')
  const { xfaErrors } = await import('../../transfer-agent/src/errors.js')
  const tables: Record<string, Record<string, { code: string }>> = { router: routerErrors, sim: simErrors, native: nativeErrors, 'transfer-agent': xfaErrors }
  t.same(duplicateCodes(...Object.values(tables)), [], 'no code in two tables')
  for (const [pkg, table] of Object.entries(tables)) {
    for (const [name, ctor] of Object.entries(table)) {
      t.equal(ctor.code, name, `${pkg}: the export name is the code (${name})`)
      t.equal([...docs.matchAll(new RegExp(`^\\| \`${name}\` \\|`, 'gm'))].length, 1, `${name} has one row in docs/errors.md`)
    }
  }
})
