import { closeSync, mkdirSync, openSync, readdirSync, readFileSync, rmSync, statSync, utimesSync } from 'node:fs'
import { createServer, type AddressInfo } from 'node:net'
import { tmpdir } from 'node:os'
import { join } from 'node:path'

/** The kernel's ephemeral port range (outgoing connections' source ports). */
function ephemeralRange(): [number, number] {
  try {
    const [low, high] = readFileSync('/proc/sys/net/ipv4/ip_local_port_range', 'utf8').trim().split(/\s+/).map(Number)
    if (low && high && low <= high) return [low, high]
  } catch {
    // not Linux: IANA's range
  }
  return [49152, 65535]
}

/** Binds `port` on `host` and releases it: the port, or undefined when it is taken. */
async function tryPort(port: number, host: string): Promise<number | undefined> {
  const server = createServer()
  const bound = await new Promise<boolean>((resolve) => {
    server.once('error', () => resolve(false))
    server.listen(port, host, () => resolve(true))
  })
  if (!bound) return undefined
  const { port: got } = server.address() as AddressInfo
  await new Promise<void>((resolve) => server.close(() => resolve()))
  return got
}

/** How long a port handed out stays claimed: its caller binds it well within this. */
const CLAIM_MS = 60_000

/**
 * Claims `port` for this caller across every process on the machine that uses freePort: a
 * file per port, created exclusively; a claim older than CLAIM_MS may be taken over. Tests run
 * in parallel processes, and two of them once got the same port between one's release and its
 * server's bind (EADDRINUSE in a full run, test/scenarios/leases).
 */
function claim(port: number): boolean {
  const dir = join(tmpdir(), 'handoff-ports')
  const file = join(dir, String(port))
  try {
    mkdirSync(dir, { recursive: true })
    if (claimed.size === 0) sweep(dir)
    closeSync(openSync(file, 'wx'))
    own(file)
    return true
  } catch (err) {
    if ((err as NodeJS.ErrnoException).code !== 'EEXIST') return true // no claims possible here: the bind check alone
  }
  try {
    if (Date.now() - statSync(file).mtimeMs < CLAIM_MS) return false
    const now = new Date()
    utimesSync(file, now, now)
    own(file)
    return true
  } catch {
    return false
  }
}

/** Claim files this process made: removed when it exits (a run used to leave hundreds behind). */
const claimed = new Set<string>()

function own(file: string): void {
  if (claimed.size === 0) process.once('exit', () => claimed.forEach((f) => rmSync(f, { force: true })))
  claimed.add(file)
}

/** Removes claims past CLAIM_MS (their processes were killed before they could): once per process. */
function sweep(dir: string): void {
  const old = Date.now() - CLAIM_MS
  for (const name of readdirSync(dir)) {
    const file = join(dir, name)
    try {
      if (statSync(file).mtimeMs < old) rmSync(file, { force: true })
    } catch {
      // another process removed it first
    }
  }
}

/**
 * A TCP port free now on `host`: bound and released at once, and claimed (see claim). Another process could take it
 * before the caller binds it; callers that must know a port before its server starts (an
 * agent told the router's URL before the router runs) accept that race and fail loudly on it.
 *
 * The port is picked below the ephemeral range. A client dialling a loopback port in that
 * range where nothing listens yet (an agent retrying its router before the router is up) can
 * be given that very port as its source port and connect to itself (TCP simultaneous open),
 * and then holds the port: the router, started a moment later, failed with EADDRINUSE (a full
 * run, test/scenarios/leases). Below the range no source port can collide.
 */
export async function freePort(host = '127.0.0.1'): Promise<number> {
  const [low] = ephemeralRange()
  const floor = 10_000
  if (low - floor > 1000) {
    for (let i = 0; i < 50; i++) {
      const port = await tryPort(floor + Math.floor(Math.random() * (low - floor)), host)
      if (port !== undefined && claim(port)) return port
    }
  }
  const port = await tryPort(0, host)
  if (port === undefined) throw new Error(`no free port on ${host}`)
  return port
}
