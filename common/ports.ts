import { createServer, type AddressInfo } from 'node:net'

/**
 * A TCP port free now on `host`: bound and released at once. Another process could take it
 * before the caller binds it; callers that must know a port before its server starts (an
 * agent told the router's URL before the router runs) accept that race and fail loudly on it.
 */
export async function freePort(host = '127.0.0.1'): Promise<number> {
  const server = createServer()
  await new Promise<void>((resolve, reject) => {
    server.once('error', reject)
    server.listen(0, host, resolve)
  })
  const { port } = server.address() as AddressInfo
  await new Promise<void>((resolve) => server.close(() => resolve()))
  return port
}
