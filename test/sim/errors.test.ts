import { readFileSync } from 'node:fs'
import t from 'tap'
import { packageRoot } from '../../common/paths.js'
import * as errors from '../../sim/src/errors.js'

t.test('every SIM_ERR code is unique, exported and documented', async (t) => {
  const codes = errors.SIM_ERROR_CODES
  t.equal(new Set(codes).size, codes.length, 'unique')
  // @fastify/error sets `code` in the constructor, so build one instance of each.
  const exported = Object.values(errors)
    .filter((v) => typeof v === 'function')
    .map((E) => (Reflect.construct(E as () => unknown, [0, 0, 0]) as { code?: unknown }).code)
    .filter((c): c is string => typeof c === 'string' && c.startsWith('SIM_ERR_'))
  t.same([...new Set(exported)].sort(), [...codes].sort(), 'the list matches the constructors')
  const doc = readFileSync(`${packageRoot}/docs/errors.md`, 'utf8')
  const section = doc.slice(doc.indexOf('## sim'))
  for (const code of codes) t.match(section, `\`${code}\``, code)
})
