import { createServer, connect, type AddressInfo, type Socket } from 'node:net'
import type { Teardown } from './cluster.js'

/*
 * A loopback TCP hop between the router and an engine that holds the engine's bytes back
 * (issue 37 item 1: a slow hop or sidecar on the way back delays P's answer after P started
 * its lease). Requests pass at once; every chunk of the answer is delivered `holdMs` after it
 * came while the hold is on.
 */

export interface SlowHop {
  /** The URL to give the router in place of the engine's. */
  readonly url: string
  /** Answers' bytes are held this long from now on (0: passed at once). */
  hold(ms: number): void
}

export async function slowHop(t: Teardown, target: string): Promise<SlowHop> {
  const { hostname, port } = new URL(target)
  let holdMs = 0
  const sockets = new Set<Socket>()
  const server = createServer((client) => {
    const engine = connect(Number(port), hostname)
    sockets.add(client).add(engine)
    for (const s of [client, engine]) {
      s.on('error', () => {
        client.destroy()
        engine.destroy()
      })
      s.on('close', () => sockets.delete(s))
    }
    client.pipe(engine)
    // In order, whatever the hold was when each chunk came: a later chunk never overtakes.
    let due = 0
    engine.on('data', (chunk: Buffer) => {
      due = Math.max(due, performance.now() + holdMs)
      const wait = due - performance.now()
      if (wait <= 0) client.write(chunk)
      else setTimeout(() => client.writable && client.write(chunk), wait)
    })
    engine.on('end', () => setTimeout(() => client.end(), Math.max(0, due - performance.now())))
    client.on('end', () => engine.end())
  })
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve))
  t.teardown(async () => {
    for (const s of sockets) s.destroy()
    await new Promise((resolve) => server.close(resolve))
  })
  return {
    url: `http://127.0.0.1:${(server.address() as AddressInfo).port}`,
    hold(ms) {
      holdMs = ms
    },
  }
}
