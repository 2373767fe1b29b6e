import t from 'tap'
import { jsonDepth, MAX_JSON_DEPTH } from '../../common/json-body.js'

t.test('jsonDepth counts nesting outside strings', async (t) => {
  t.equal(jsonDepth('1'), 0)
  t.equal(jsonDepth('{"a":[1,{"b":[]}]}'), 4)
  t.equal(jsonDepth('{"a":"[[[{{"}'), 1, 'brackets inside a string do not count')
  t.equal(jsonDepth('{"a":"\\"[[[","b":[]}'), 2, 'an escaped quote does not end the string')
  t.equal(jsonDepth('["\\\\",[[]]]'), 3, 'an escaped backslash does')
  t.equal(jsonDepth('[["a\\\\\\"[[",[]]]'), 3, 'a backslash pair, then an escaped quote: still inside')
  t.equal(jsonDepth(`{"p":"${'x[{'.repeat(50_000)}","q":[[1]]}`), 3, 'a long string is skipped whole')
  t.equal(jsonDepth('[["abc'), 2, 'an unterminated string ends the count (the parser reports the error)')
  t.equal(jsonDepth('['.repeat(200_000), MAX_JSON_DEPTH), MAX_JSON_DEPTH + 1, 'stops once past the limit')
  t.equal(jsonDepth('['.repeat(MAX_JSON_DEPTH) + ']'.repeat(MAX_JSON_DEPTH), MAX_JSON_DEPTH), MAX_JSON_DEPTH, 'the limit itself is allowed')
})
