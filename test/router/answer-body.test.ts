import t from 'tap'
import { AnswerBody } from '../../router/src/proxy/answer-body.js'

const KiB = 1024

/** A body fed by hand, counting the resumes the dispatcher would get. */
function fed(): { body: AnswerBody; resumes: () => number } {
  let resumes = 0
  return { body: new AnswerBody(() => resumes++), resumes: () => resumes }
}

t.test('whole: every chunk, once the answer ended; a whole read never pauses the socket', async (t) => {
  const { body, resumes } = fed()
  const whole = body.whole()
  for (let i = 0; i < 40; i++) t.ok(body.push(Buffer.alloc(4 * KiB, i)), `chunk ${i} goes on (160 KiB in all)`)
  body.end()
  const buf = await whole
  t.equal(buf.length, 160 * KiB)
  t.equal(buf[4 * KiB * 39], 39, 'in order')
  t.equal(resumes(), 0)
})

t.test('iteration: the chunks that came meanwhile in one Buffer, then the end', async (t) => {
  const { body } = fed()
  body.push(Buffer.from('a'))
  body.push(Buffer.from('b'))
  const seen: string[] = []
  const reading = (async () => {
    for await (const c of body) seen.push(c.toString())
  })()
  await new Promise((resolve) => setImmediate(resolve))
  body.push(Buffer.from('c'))
  await new Promise((resolve) => setImmediate(resolve))
  body.end()
  await reading
  t.same(seen, ['ab', 'c'])
})

t.test('a failure: what came before it is read first, then the error', async (t) => {
  const { body } = fed()
  body.push(Buffer.from('data: 1\n\n'))
  body.fail(new Error('reset'))
  t.ok(body.failed)
  const seen: string[] = []
  await t.rejects(
    (async () => {
      for await (const c of body) seen.push(c.toString())
    })(),
    { message: 'reset' },
  )
  t.same(seen, ['data: 1\n\n'])
  await t.rejects(body.whole(), { message: 'reset' }, 'a whole read fails too')
})

t.test('a reader that falls 64 KiB behind pauses the socket; catching up resumes it once', async (t) => {
  const { body, resumes } = fed()
  let goesOn = true
  let pushed = 0
  while (goesOn && pushed < 100) {
    goesOn = body.push(Buffer.alloc(16 * KiB))
    pushed++
  }
  t.equal(pushed, 4, 'paused at the fourth 16 KiB chunk')
  const it = body[Symbol.asyncIterator]()
  const first = await it.next()
  t.equal(first.value?.length, 64 * KiB, 'the reader takes all that waited')
  t.equal(resumes(), 1, 'and the socket goes on')
  t.ok(body.push(Buffer.alloc(KiB)), 'below the mark again')
  body.end()
  t.equal((await it.next()).value?.length, KiB)
  t.ok((await it.next()).done)
  t.equal(resumes(), 1)
})

t.test('a whole read after a pause resumes the socket', async (t) => {
  const { body, resumes } = fed()
  for (let i = 0; i < 4; i++) body.push(Buffer.alloc(16 * KiB))
  const whole = body.whole()
  t.equal(resumes(), 1)
  t.ok(body.push(Buffer.alloc(16 * KiB)), 'no pause while read whole')
  body.end()
  t.equal((await whole).length, 80 * KiB)
})
