// The NAT_ERR_* table: unique, exported, documented, and the native-error mapping.
import { existsSync, readFileSync } from 'node:fs'
import { join } from 'node:path'
import t from 'tap'
import { packageRoot } from '../../common/paths.js'
import * as gate from '../../native/index.js'
import { fromNative, isNativeErrorCode, nativeError, nativeErrors } from '../../native/errors.js'

t.test('codes are unique, exported and carry a status', async (t) => {
  const codes = Object.keys(nativeErrors)
  t.equal(new Set(codes).size, codes.length)
  for (const code of codes) {
    t.match(code, /^NAT_ERR_[A-Z_]+$/)
    t.equal((gate as Record<string, unknown>)[code], nativeErrors[code as keyof typeof nativeErrors], `${code} exported by the gate`)
    const err = nativeError(code as keyof typeof nativeErrors, 'detail')
    t.equal(err.code, code)
    t.type(err.statusCode, 'number')
    t.ok(err instanceof nativeErrors[code as keyof typeof nativeErrors])
  }
})

t.test('every code is listed in docs/errors.md', async (t) => {
  const doc = join(packageRoot, 'docs', 'errors.md')
  t.ok(existsSync(doc), 'docs/errors.md exists')
  const text = readFileSync(doc, 'utf8')
  const section = text.slice(text.indexOf('## native (NAT_ERR_*)'))
  for (const code of Object.keys(nativeErrors)) t.match(section, `| \`${code}\``, `${code} documented`)
})

t.test('fromNative maps addon errors by code and keeps the details', async (t) => {
  const raw = Object.assign(new Error('nixl_capi_post_xfer_req returned -2'), {
    code: 'NAT_ERR_REMOTE_DISCONNECT',
    nixlStatus: -2,
    nixlOp: 'nixl_capi_post_xfer_req',
    peer: 'p1',
  })
  const err = fromNative(raw)
  t.equal(err.code, 'NAT_ERR_REMOTE_DISCONNECT')
  t.equal(err.statusCode, 502)
  t.equal(err.nixlStatus, -2)
  t.equal(err.nixlOp, 'nixl_capi_post_xfer_req')
  t.equal(err.peer, 'p1')
  t.equal(err.cause, raw, 'the original is the cause')
  t.match(err.message, /peer disconnected: nixl_capi_post_xfer_req returned -2/)
  t.equal(fromNative(err), err, 'already coded errors pass through')

  const unknown = fromNative(new Error('boom'))
  t.equal(unknown.code, 'NAT_ERR_NIXL_EXCEPTION', 'uncoded errors still get a code')
  t.equal(fromNative('text').code, 'NAT_ERR_NIXL_EXCEPTION')
  t.equal(isNativeErrorCode('NAT_ERR_SHM'), true)
  t.equal(isNativeErrorCode('RTR_ERR_X'), false)
  t.equal(isNativeErrorCode(7), false)
})
