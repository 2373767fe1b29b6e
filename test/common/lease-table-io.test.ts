import { createServer, type AddressInfo } from 'node:net'
import { Worker } from 'node:worker_threads'
import t from 'tap'
import { systemClock } from '../../common/clock.js'
import { LeaseTable, type LeaseEndReason } from '../../common/lease-table.js'

/*
 * Issue 17 item 1, a slow P: the prefiller's event loop is busy past a lease's deadline while
 * a heartbeat for it has already reached the process (here a socket message from a worker
 * thread, as the NIXL thread's notification would be). libuv runs the due timers (the
 * reaper) before the poll phase that delivers that message, so a reap straight from its timer
 * ends the lease its heartbeat was extending, and D reads reused blocks. With `defer:
 * setImmediate` the reap runs after the pending I/O, and the heartbeat lands first.
 */

async function busyPrefiller(defer: ((fn: () => void) => void) | undefined): Promise<{ ended: LeaseEndReason[]; heartbeatFound: boolean | undefined }> {
  const ended: LeaseEndReason[] = []
  const table = new LeaseTable<null>({ clock: systemClock, leaseMs: 300, reapIntervalMs: 20, ...(defer ? { defer } : {}), onEnd: (_l, r) => ended.push(r) })
  let heartbeatFound: boolean | undefined
  // Busy for 400 ms: past the deadline (300 ms), with the heartbeat waiting since about 150 ms.
  // The work runs in the check phase (setImmediate, as I/O callbacks' follow-ups do): the next
  // loop turn starts with the due timers, the reaper among them, then polls.
  const busy = (): void => {
    setImmediate(() => {
      const until = performance.now() + 400
      while (performance.now() < until) {
        // a long GC pause, a burst of work: the loop does not turn
      }
    })
  }
  const got = new Promise<void>((resolve) => {
    const server = createServer((socket) => {
      // The decoder is connected: the lease starts now, and so does the busy stretch.
      table.pin('r', null)
      table.start()
      busy()
      socket.once('data', () => {
        heartbeatFound = table.heartbeat('r')
        socket.destroy()
        server.close()
        resolve()
      })
    })
    server.listen(0, '127.0.0.1', () => {
      const { port } = server.address() as AddressInfo
      // The decoder's heartbeat: sent 150 ms after it connected, well inside the 300 ms lease.
      const worker = new Worker(
        `const net = require('node:net'); const { workerData } = require('node:worker_threads');
         const s = net.connect(workerData.port, '127.0.0.1', () => setTimeout(() => s.end('HB:r'), 150))`,
        { eval: true, workerData: { port } },
      )
      worker.on('error', () => undefined)
    })
  })
  await got
  await new Promise((r) => setTimeout(r, 30))
  table.stop()
  return { ended, heartbeatFound }
}

t.test('a reap straight from the timer ends a lease whose heartbeat is already queued (the defect)', async (t) => {
  const r = await busyPrefiller(undefined)
  t.same(r.ended, ['expired'], 'reaped first')
  t.equal(r.heartbeatFound, false, 'the heartbeat that had arrived in time found no lease')
})

t.test('with defer: setImmediate the queued heartbeat is applied before the reap', async (t) => {
  const r = await busyPrefiller(setImmediate)
  t.equal(r.heartbeatFound, true, 'the heartbeat extended the lease')
  t.same(r.ended, [], 'nothing reaped: the lease is alive')
})
