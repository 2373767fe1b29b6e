import { createServer, connect, type Server, type Socket } from 'node:net'
import { once } from 'node:events'

/**
 * A TCP proxy on a loopback port, in front of a real process, that a test or a bench can take
 * down and bring back at the same address: while it is down, connections are refused, as they
 * are by an engine that died (a process cannot be made to refuse connections and then answer
 * again at its address without a restart). Bytes pass through unchanged.
 */
export interface TcpProxy {
  port: number
  url: string
  /** Refuses new connections and resets the open ones. */
  down(): Promise<void>
  /** Listens again at the same port. */
  up(): Promise<void>
}

/** `onStop` gets the proxy's stop (a test's teardown, a bench's cleanup). */
export async function startTcpProxy(target: { host: string; port: number }, onStop: (stop: () => Promise<void>) => void): Promise<TcpProxy> {
  const sockets = new Set<Socket>()
  let server: Server | undefined
  let port = 0
  const up = async (): Promise<void> => {
    const s = createServer((client) => {
      const upstream = connect(target.port, target.host)
      for (const sock of [client, upstream]) {
        sockets.add(sock)
        sock.once('close', () => sockets.delete(sock))
        sock.on('error', () => {
          client.destroy()
          upstream.destroy()
        })
      }
      client.pipe(upstream).pipe(client)
    })
    s.listen(port, '127.0.0.1')
    await once(s, 'listening')
    port = (s.address() as { port: number }).port
    server = s
  }
  const down = async (): Promise<void> => {
    const s = server
    server = undefined
    for (const sock of sockets) sock.resetAndDestroy()
    if (s) await new Promise((resolve) => s.close(resolve))
  }
  await up()
  onStop(down)
  return { port, url: `http://127.0.0.1:${port}`, down, up }
}
