/**
 * How a handoff child process tells its parent it is serving: one IPC message. Parents
 * (`handoff up`, tests, benchmarks) spawn with an IPC channel and wait for it; a process
 * started by hand has no channel and this is a no-op.
 */
export interface ReadyMessage {
  type: 'handoff:ready'
  service: string
  url: string
}

export function isReadyMessage(msg: unknown): msg is ReadyMessage {
  return (
    typeof msg === 'object' &&
    msg !== null &&
    (msg as { type?: unknown }).type === 'handoff:ready' &&
    typeof (msg as { url?: unknown }).url === 'string'
  )
}

export function announceReady(service: string, url: string): void {
  if (typeof process.send === 'function' && process.connected) {
    const msg: ReadyMessage = { type: 'handoff:ready', service, url }
    process.send(msg)
  }
}

/**
 * A process spawned with an IPC channel lives only as long as its parent: the channel closes
 * when the parent dies (even by SIGKILL), and the process then shuts down gracefully rather
 * than live on as an orphan holding a port. From the start, not from readiness: a parent
 * killed while its child is still starting must not leave the child behind. Called once, by
 * the `handoff` entry point.
 */
export function followParent(): void {
  if (typeof process.send !== 'function') return
  if (!process.connected) {
    process.kill(process.pid, 'SIGTERM')
    return
  }
  process.once('disconnect', () => process.kill(process.pid, 'SIGTERM'))
}
