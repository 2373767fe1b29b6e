import t from 'tap'
import { jsonDepth, MAX_JSON_DEPTH } from '../../common/json-body.js'

t.test('jsonDepth counts nesting outside strings', async (t) => {
  t.equal(jsonDepth('1'), 0)
  t.equal(jsonDepth('{"a":[1,{"b":[]}]}'), 4)
  t.equal(jsonDepth('{"a":"[[[{{"}'), 1, 'brackets inside a string do not count')
  t.equal(jsonDepth('{"a":"\\"[[[","b":[]}'), 2, 'an escaped quote does not end the string')
  t.equal(jsonDepth('["\\\\",[[]]]'), 3, 'an escaped backslash does')
  t.equal(jsonDepth('['.repeat(200_000), MAX_JSON_DEPTH), MAX_JSON_DEPTH + 1, 'stops once past the limit')
  t.equal(jsonDepth('['.repeat(MAX_JSON_DEPTH) + ']'.repeat(MAX_JSON_DEPTH), MAX_JSON_DEPTH), MAX_JSON_DEPTH, 'the limit itself is allowed')
})
