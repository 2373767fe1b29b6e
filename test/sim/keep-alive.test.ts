import { connect } from 'node:net'
import t from 'tap'
import { validateSimConfig } from '../../sim/src/config.js'
import { build } from './build.js'

/** Opens a socket, sends one keep-alive request, and resolves with ms from response to close. */
async function idleCloseMs(port: number, boundMs: number): Promise<number> {
  return new Promise((resolve, reject) => {
    const socket = connect({ host: '127.0.0.1', port })
    let answeredAt = 0
    const bound = setTimeout(() => {
      socket.destroy()
      reject(new Error(`socket still open after ${boundMs} ms`))
    }, boundMs)
    socket.on('data', (chunk) => {
      if (!answeredAt && chunk.toString().startsWith('HTTP/1.1 200')) answeredAt = performance.now()
    })
    socket.on('error', reject)
    socket.on('close', () => {
      clearTimeout(bound)
      if (!answeredAt) reject(new Error('closed before the answer'))
      else resolve(performance.now() - answeredAt)
    })
    socket.write('GET /health HTTP/1.1\r\nHost: x\r\nConnection: keep-alive\r\n\r\n')
  })
}

t.test('idle keep-alive sockets close after keepAliveMs (uvicorn: 5 s by default)', async (t) => {
  t.equal(validateSimConfig({}).keepAliveMs, 5000)
  const defaults = build(t)
  t.equal(defaults.app.server.keepAliveTimeout, 5000)

  const { app } = build(t, { keepAliveMs: 300 })
  await app.listen({ host: '127.0.0.1', port: 0 })
  const { port } = app.server.address() as { port: number }
  const ms = await idleCloseMs(port, 4000)
  // Generous bounds for a loaded machine; the default (5 s) could not close before 4 s.
  t.ok(ms >= 200, `closed after ${Math.round(ms)} ms, not at once`)
})
