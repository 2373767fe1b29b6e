import { readFileSync } from 'node:fs'
import { createServer } from 'node:net'
import t from 'tap'
import { freePort } from '../../common/ports.js'

t.test('freePort: a bindable port below the ephemeral range, so no client can connect to itself on it', async (t) => {
  const [low] = readFileSync('/proc/sys/net/ipv4/ip_local_port_range', 'utf8').trim().split(/\s+/).map(Number)
  const seen = new Set<number>()
  for (let i = 0; i < 20; i++) {
    const port = await freePort()
    t.ok(port >= 10_000 && port < (low as number), `${port} below ${low}`)
    seen.add(port)
    const server = createServer()
    await new Promise<void>((resolve, reject) => {
      server.once('error', reject)
      server.listen(port, '127.0.0.1', resolve)
    })
    await new Promise<void>((resolve) => server.close(() => resolve()))
  }
  t.ok(seen.size > 10, `spread over the range (${seen.size} distinct of 20)`)
})
