import { createServer, connect, type Server, type Socket } from 'node:net'
import { once } from 'node:events'

/**
 * A TCP proxy on a loopback port, in front of a real process (an engine, Redis), that a test
 * or a bench can break the two ways a network does:
 * - down: connections are refused and the open ones reset, as by a process that died (a
 *   process cannot be made to refuse connections and answer again at its address without a
 *   restart); up listens again at the same port;
 * - blackhole: the open connections stay open but carry nothing more, either way, and new ones
 *   are accepted and carry nothing, as behind a link or firewall that drops packets without a
 *   reset; heal lets new connections through again, while the blackholed ones stay silent
 *   until a side gives up on them (nothing tells either side otherwise).
 * Bytes that pass, pass unchanged.
 */
export interface TcpProxy {
  port: number
  url: string
  /** Refuses new connections and resets the open ones. */
  down(): Promise<void>
  /** Listens again at the same port. */
  up(): Promise<void>
  /** Open and new connections carry nothing, and nothing is reset. */
  blackhole(): void
  /** New connections carry bytes again; the blackholed ones stay silent. */
  heal(): void
}

/** `onStop` gets the proxy's stop (a test's teardown, a bench's cleanup). */
export async function startTcpProxy(target: { host: string; port: number }, onStop: (stop: () => Promise<void>) => void): Promise<TcpProxy> {
  const sockets = new Set<Socket>()
  const pairs = new Set<[Socket, Socket]>()
  let server: Server | undefined
  let port = 0
  let holed = false
  const track = (sock: Socket, peer?: Socket): void => {
    sockets.add(sock)
    sock.once('close', () => sockets.delete(sock))
    sock.on('error', () => {
      sock.destroy()
      peer?.destroy()
    })
  }
  /** Drops what the socket sends from now on, and sends it nothing. */
  const silence = (sock: Socket): void => {
    sock.unpipe()
    sock.removeAllListeners('data')
    sock.on('data', () => {})
    sock.resume()
  }
  const up = async (): Promise<void> => {
    const s = createServer((client) => {
      if (holed) {
        track(client)
        silence(client)
        return
      }
      const upstream = connect(target.port, target.host)
      track(client, upstream)
      track(upstream, client)
      const pair: [Socket, Socket] = [client, upstream]
      pairs.add(pair)
      client.once('close', () => pairs.delete(pair))
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
  const blackhole = (): void => {
    holed = true
    for (const pair of pairs) pair.forEach(silence)
    pairs.clear()
  }
  const heal = (): void => {
    holed = false
  }
  await up()
  onStop(down)
  return { port, url: `http://127.0.0.1:${port}`, down, up, blackhole, heal }
}
