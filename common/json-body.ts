import type { FastifyInstance } from 'fastify'

/**
 * How deep a JSON body may nest. OpenAI bodies (messages, tools, JSON schemas) stay far
 * below; a body nested 200k deep parses (V8's JSON.parse does not recurse) and then
 * overflows the stack in whatever walks it next (validation, JSON.stringify), a 500
 * (issue 18 item 4).
 */
export const MAX_JSON_DEPTH = 512

/**
 * The nesting depth of a JSON text, counted without parsing; stops once past `limit`. Strings
 * (a prompt is most of a body) are skipped with indexOf, which V8 runs far faster than a
 * loop over their characters.
 */
export function jsonDepth(text: string, limit = Infinity): number {
  let depth = 0
  let max = 0
  for (let i = 0; i < text.length; i++) {
    const c = text.charCodeAt(i)
    if (c === 0x22) {
      // The closing quote: the next one not escaped by an odd run of backslashes.
      let end = text.indexOf('"', i + 1)
      while (end !== -1) {
        let slashes = 0
        while (text.charCodeAt(end - 1 - slashes) === 0x5c) slashes++
        if (slashes % 2 === 0) break
        end = text.indexOf('"', end + 1)
      }
      if (end === -1) return max // unterminated: the parser says what is wrong
      i = end
    } else if (c === 0x5b || c === 0x7b) {
      if (++depth > max) {
        max = depth
        if (max > limit) return max
      }
    } else if (c === 0x5d || c === 0x7d) depth--
  }
  return max
}

/**
 * Replaces the app's application/json parser with fastify's own (the same proto and
 * constructor poisoning rules) behind a depth check. A body nested deeper than `maxDepth`
 * fails as a SyntaxError with statusCode 400, which each app's error handler maps onto its
 * invalid-JSON code.
 */
export function limitJsonDepth(app: FastifyInstance, maxDepth = MAX_JSON_DEPTH): void {
  const parse = app.getDefaultJsonParser('error', 'error')
  app.removeContentTypeParser('application/json')
  app.addContentTypeParser('application/json', { parseAs: 'string' }, (req, body, done) => {
    const text = body as string
    if (jsonDepth(text, maxDepth) > maxDepth) {
      done(Object.assign(new SyntaxError(`JSON nested deeper than ${maxDepth} levels`), { statusCode: 400 }), undefined)
      return
    }
    parse(req, text, done)
  })
}
