// POSIX shared memory mapped into ArrayBuffers (a simulator and its agent share one KV region).
import { fromNative } from './errors.js'
import { native } from './binding.js'

export interface SharedMemory {
  readonly name: string
  /** Backed by the shared pages; detached (length 0) after unmap(). */
  readonly buffer: ArrayBuffer
  readonly size: number
  readonly address: bigint
  /**
   * Unmaps now instead of at garbage collection. Throws NAT_ERR_MEMORY_IN_USE while a NIXL
   * agent has the region registered (a READ may be writing into it): deregister first.
   */
  unmap(): void
  /** Removes the name; mappings stay valid until unmapped. */
  unlink(): boolean
}

export interface SharedMemoryOptions {
  /** Create (and size) the region if it does not exist. */
  create?: boolean
  /** With create: fail if it already exists. */
  exclusive?: boolean
  /**
   * Hold an exclusive lock on the object while mapped: mapping it again with `lock`, from any
   * process, fails (NAT_ERR_SHM, "held by another mapping") until this mapping is unmapped.
   */
  lock?: boolean
}

/**
 * Maps the POSIX shared-memory object `name` ("/something") into an ArrayBuffer. With
 * `create`, the object is created and sized to `size`; otherwise it must exist and be at
 * least `size` bytes (0 maps the whole object).
 */
export function mapSharedMemory(name: string, size: number, opts: SharedMemoryOptions = {}): SharedMemory {
  const n = native()
  let buffer: ArrayBuffer
  try {
    buffer = n.mapShared(name, size, opts.create ?? false, opts.exclusive ?? false, opts.lock ?? false)
  } catch (err) {
    throw fromNative(err)
  }
  const address = n.bufferAddress(buffer)
  return {
    name,
    buffer,
    size: buffer.byteLength,
    address,
    unmap: () => {
      try {
        n.unmapShared(buffer)
      } catch (err) {
        throw fromNative(err)
      }
    },
    unlink: () => unlinkSharedMemory(name),
  }
}

export function unlinkSharedMemory(name: string): boolean {
  try {
    return native().unlinkShared(name)
  } catch (err) {
    throw fromNative(err)
  }
}
