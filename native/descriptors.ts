// Memory, descriptors and registrations: what a READ names on each side.
import { nativeError } from './errors.js'
import { native } from './binding.js'

export type MemoryKind = 'dram' | 'vram'

/** One contiguous range: a DRAM address, or a GPU address with its ordinal as devId. */
export interface Descriptor {
  addr: bigint
  len: number
  devId?: number
}

export interface ExternalRegion extends Descriptor {
  kind: MemoryKind
}

/** What can be registered: JS-owned memory (DRAM) or an address range the caller owns. */
export type MemoryRegion = ArrayBuffer | ArrayBufferView | ExternalRegion

/** Descriptors as objects, or packed (addr, len, devId) triples from {@link packDescriptors}. */
export type DescriptorInput = readonly Descriptor[] | BigUint64Array

export const KIND_CODE: Record<MemoryKind, number> = { dram: 0, vram: 1 }

/** Address of JS memory (start of the view); valid while the memory is referenced. */
export function addressOf(buffer: ArrayBuffer | ArrayBufferView): bigint {
  return native().bufferAddress(buffer)
}

/** (addr, len, devId) triples, the addon's wire format; build once when reused. */
export function packDescriptors(descs: readonly Descriptor[]): BigUint64Array {
  const out = new BigUint64Array(descs.length * 3)
  descs.forEach((d, i) => {
    if (!Number.isSafeInteger(d.len) || d.len <= 0) throw nativeError('NAT_ERR_INVALID_ARG', `descriptor ${i} has bad length ${d.len}`)
    out[i * 3] = d.addr
    out[i * 3 + 1] = BigInt(d.len)
    out[i * 3 + 2] = BigInt(d.devId ?? 0)
  })
  return out
}

export function triples(d: DescriptorInput): BigUint64Array {
  return d instanceof BigUint64Array ? d : packDescriptors(d)
}

export function isExternal(r: MemoryRegion): r is ExternalRegion {
  return !(r instanceof ArrayBuffer) && !ArrayBuffer.isView(r) && typeof (r as ExternalRegion).addr === 'bigint'
}

/**
 * Memory registered with one agent. It counts the READs whose destination lies in it, from
 * submission until no byte can still land (a tainted READ counts until it is quiescent);
 * while that count is positive, deregistration, close and shared-memory unmap refuse.
 */
export class Registration {
  readonly addr: bigint
  readonly len: number
  readonly devId: number
  readonly kind: MemoryKind
  #readers = 0
  #idle: (() => void)[] = []

  /** @internal created by NixlAgent.registerMemory */
  constructor(addr: bigint, len: number, devId: number, kind: MemoryKind) {
    this.addr = addr
    this.len = len
    this.devId = devId
    this.kind = kind
  }

  /** READs in flight into this memory, tainted ones included. */
  get readers(): number {
    return this.#readers
  }

  /** The descriptor of `len` bytes at `offset` inside this registration. */
  slice(offset: number, len: number): Descriptor {
    if (!Number.isSafeInteger(offset) || !Number.isSafeInteger(len) || offset < 0 || len <= 0 || offset + len > this.len) {
      throw nativeError('NAT_ERR_INVALID_ARG', `slice ${offset}+${len} outside a registration of ${this.len} bytes`)
    }
    return { addr: this.addr + BigInt(offset), len, devId: this.devId }
  }

  /** Whether [addr, addr + len) lies inside this registration (same device). */
  contains(addr: bigint, len: bigint, devId: bigint): boolean {
    return devId === BigInt(this.devId) && addr >= this.addr && addr + len <= this.addr + BigInt(this.len)
  }

  /** @internal */
  pin(): void {
    this.#readers++
  }

  /** @internal */
  unpin(): void {
    if (this.#readers > 0) this.#readers--
    if (this.#readers === 0) for (const wake of this.#idle.splice(0)) wake()
  }

  /** @internal resolves once no READ is in flight into this memory */
  idle(): Promise<void> {
    if (this.#readers === 0) return Promise.resolve()
    return new Promise((resolve) => this.#idle.push(resolve))
  }
}

/**
 * The NIXL agent name inside a metadata blob, read without loading it, or null when the blob
 * does not look like NIXL 1.x metadata. NIXL's serializer writes "nixlSerDes|", then each
 * field as tag, 8-byte little-endian length, bytes and "|"; the first field is "Agent".
 * Knowing the name first lets the gate release an older engine_id that used the same name
 * (a restarted peer) before NIXL sees the new metadata.
 */
export function metadataAgentName(md: Buffer): string | null {
  const head = 'nixlSerDes|Agent'
  if (md.length < head.length + 8 || md.toString('latin1', 0, head.length) !== head) return null
  const len = md.readBigUInt64LE(head.length)
  const start = head.length + 8
  if (len === 0n || BigInt(start) + len >= BigInt(md.length)) return null
  const end = start + Number(len)
  if (md[end] !== 0x7c) return null // '|'
  return md.toString('utf8', start, end)
}
