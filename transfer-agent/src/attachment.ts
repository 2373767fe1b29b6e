import {
  createAgent,
  mapSharedMemory,
  type NixlAgent,
  type PreparedBlocks,
  type Registration,
  type SharedMemory,
} from '../../native/index.js'
import type { AgentAttach } from '../../schemas/agent-api.js'
import { xfaError } from './errors.js'

/**
 * One attached engine: its KV region (the engine's shared-memory file, mapped here too), the
 * NIXL agent named after its engine_id with that region registered, and the region prepared
 * as blocks once, so every pull is one `make_xfer_req` by block index. A new engine_id (the
 * engine restarted) gets a new attachment: NIXL names agents at creation, and a peer must see
 * a new name for a new incarnation. The region is locked while attached (one agent per
 * region, across processes): an agent whose peers could read another engine's region would
 * hand them that engine's KV, and its READs would write into that engine's blocks.
 */
export class Attachment {
  readonly engineId: string
  readonly role: AgentAttach['role']
  readonly blockSize: number
  readonly bytesPerToken: number
  readonly numBlocks: number
  readonly blockBytes: number
  readonly shm: SharedMemory
  readonly nixl: NixlAgent
  readonly registration: Registration
  readonly blocks: PreparedBlocks
  readonly metadata: Buffer
  readonly request: Readonly<AgentAttach>

  private constructor(req: AgentAttach, shm: SharedMemory, nixl: NixlAgent, reg: Registration, blocks: PreparedBlocks, md: Buffer) {
    this.request = Object.freeze({ ...req })
    this.engineId = req.engineId
    this.role = req.role
    this.blockSize = req.blockSize
    this.bytesPerToken = req.bytesPerToken
    this.numBlocks = req.numBlocks
    this.blockBytes = req.blockSize * req.bytesPerToken
    this.shm = shm
    this.nixl = nixl
    this.registration = reg
    this.blocks = blocks
    this.metadata = md
  }

  /** Whether `req` describes this same attachment (a repeated attach is a no-op). */
  sameAs(req: AgentAttach): boolean {
    const r = this.request
    return (
      r.engineId === req.engineId &&
      r.role === req.role &&
      r.shmName === req.shmName &&
      r.blockSize === req.blockSize &&
      r.bytesPerToken === req.bytesPerToken &&
      r.numBlocks === req.numBlocks
    )
  }

  static async open(req: AgentAttach, nixlOptions: { ucxParams?: Record<string, string> } = {}): Promise<Attachment> {
    const bytes = req.numBlocks * req.blockSize * req.bytesPerToken
    let shm: SharedMemory
    try {
      // Locked for as long as this attachment lives: no other agent can map the region.
      shm = mapSharedMemory(req.shmName, bytes, { lock: true })
    } catch (cause) {
      if (/held by another mapping/.test(String((cause as Error).message))) {
        throw xfaError('XFA_ERR_REGION_IN_USE', `${req.shmName} is held by another agent (or an earlier attachment of this one)`, { engineId: req.engineId, cause })
      }
      throw xfaError('XFA_ERR_ATTACH_FAILED', `cannot map ${req.shmName} (${bytes} bytes)`, { engineId: req.engineId, cause })
    }
    let nixl: NixlAgent | undefined
    try {
      // Notifications are handled as events (agent.ts); nothing waits for them by match.
      nixl = await createAgent(req.engineId, { notificationBuffer: 0 })
      await nixl.createBackend('UCX', nixlOptions.ucxParams ?? {})
      const reg = await nixl.registerMemory(new Uint8Array(shm.buffer, 0, bytes))
      const blocks = await nixl.prepareLocalBlocks(reg, req.blockSize * req.bytesPerToken)
      const md = await nixl.localMetadata()
      return new Attachment(req, shm, nixl, reg, blocks, md)
    } catch (cause) {
      await nixl?.close().catch(() => undefined)
      unmapQuietly(shm)
      throw xfaError('XFA_ERR_ATTACH_FAILED', `cannot register ${req.shmName} with NIXL`, { engineId: req.engineId, cause })
    }
  }

  /**
   * Closes the NIXL agent (it cancels READs and waits until they are quiescent before it
   * deregisters) and only then unmaps: memory under a READ is never unmapped.
   */
  async close(): Promise<void> {
    await this.nixl.close()
    unmapQuietly(this.shm)
  }
}

function unmapQuietly(shm: SharedMemory): void {
  try {
    shm.unmap()
  } catch {
    // Still registered (close failed): the mapping is released at garbage collection instead.
  }
}
