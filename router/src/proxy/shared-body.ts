type Body = Record<string, unknown>

const OPEN = Buffer.from('{')
const CLOSE = Buffer.from('}')
const COMMA = Buffer.from(',')

function member(key: string, value: unknown): Buffer {
  return Buffer.from(`${JSON.stringify(key)}:${JSON.stringify(value)}`)
}

/**
 * A client's body serialised once for all the legs it fans out into (issue 18 item 3). A
 * batch of 128 prompts with a 5 MB pass-through field used to be 256 copies of it, one
 * JSON.stringify per leg; here each leg's JSON is the body's members in runs shared by every
 * leg, with only the members that leg changes serialised for it. The members a leg may change
 * (`volatile`) are cut out of the runs; any other change still serialises correctly, member
 * by member, only without sharing.
 *
 * The body is the parsed client body and is never modified.
 */
export class SharedBody {
  readonly body: Readonly<Body>
  readonly #volatile: ReadonlySet<string>
  #segments: ({ run: Buffer; keys: string[] } | { key: string })[] | undefined
  readonly #members = new Map<string, Buffer>()
  /** Members views set, by key and value: a batch prompt is serialised once for both its legs. */
  readonly #set = new Map<string, Map<unknown, Buffer>>()

  /** `volatile`: a Set is used as it is (callers keep one for every request). */
  constructor(body: Body, volatile: Iterable<string>) {
    this.body = body
    this.#volatile = volatile instanceof Set ? volatile : new Set(volatile)
  }

  /** The root view: the body as it is. */
  view(): BodyView {
    return new BodyView(this, new Set(), new Map(), new Map())
  }

  isVolatile(key: string): boolean {
    return this.#volatile.has(key)
  }

  /** `"key":value` of the body's own member, serialised once. */
  member(key: string): Buffer {
    let m = this.#members.get(key)
    if (!m) {
      m = member(key, this.body[key])
      this.#members.set(key, m)
    }
    return m
  }

  /** `"key":value` of a member a view set. */
  setMember(key: string, value: unknown): Buffer {
    let byValue = this.#set.get(key)
    if (!byValue) {
      byValue = new Map()
      this.#set.set(key, byValue)
    }
    let m = byValue.get(value)
    if (!m) {
      m = member(key, value)
      byValue.set(value, m)
    }
    return m
  }

  /** Runs of members no leg changes (one Buffer each), and the volatile members between them. */
  segments(): readonly ({ run: Buffer; keys: string[] } | { key: string })[] {
    if (this.#segments) return this.#segments
    const out: ({ run: Buffer; keys: string[] } | { key: string })[] = []
    let keys: string[] = []
    let parts: string[] = []
    const flush = (): void => {
      if (keys.length > 0) out.push({ run: Buffer.from(parts.join(',')), keys })
      keys = []
      parts = []
    }
    // Object.keys is JSON.stringify's order (integer-like keys first), and skips nothing JSON has.
    for (const k of Object.keys(this.body)) {
      if (this.#volatile.has(k)) {
        flush()
        out.push({ key: k })
      } else if (this.body[k] !== undefined) {
        keys.push(k)
        parts.push(`${JSON.stringify(k)}:${JSON.stringify(this.body[k])}`)
      }
    }
    flush()
    this.#segments = out
    return out
  }
}

/**
 * A body as the shared one with some members of its own: dropped, replaced in place, or
 * appended after the shared ones, exactly as the same changes on a copy of the object
 * (`{ ...body, k: v }`, `delete`) would order them. Views are immutable; `with` and
 * `without` derive new ones.
 */
export class BodyView {
  readonly #shared: SharedBody
  readonly #dropped: ReadonlySet<string>
  readonly #replaced: ReadonlyMap<string, unknown>
  readonly #appended: ReadonlyMap<string, unknown>
  /** Whether a member outside the volatile ones changed: its run cannot be shared as it is. */
  readonly #splitsRuns: boolean

  constructor(shared: SharedBody, dropped: ReadonlySet<string>, replaced: ReadonlyMap<string, unknown>, appended: ReadonlyMap<string, unknown>) {
    this.#shared = shared
    this.#dropped = dropped
    this.#replaced = replaced
    this.#appended = appended
    this.#splitsRuns = [...dropped, ...replaced.keys()].some((k) => !shared.isVolatile(k))
  }

  get(key: string): unknown {
    if (this.#appended.has(key)) return this.#appended.get(key)
    if (this.#dropped.has(key) || !Object.hasOwn(this.#shared.body, key)) return undefined
    return this.#replaced.has(key) ? this.#replaced.get(key) : this.#shared.body[key]
  }

  /** Sets members in order: in place where the body has them, else after its members. */
  with(fields: Body): BodyView {
    const replaced = new Map(this.#replaced)
    const appended = new Map(this.#appended)
    for (const [k, v] of Object.entries(fields)) {
      if (appended.has(k)) appended.set(k, v)
      else if (Object.hasOwn(this.#shared.body, k) && !this.#dropped.has(k)) replaced.set(k, v)
      else appended.set(k, v)
    }
    return new BodyView(this.#shared, this.#dropped, replaced, appended)
  }

  without(keys: readonly string[]): BodyView {
    const dropped = new Set(this.#dropped)
    const replaced = new Map(this.#replaced)
    const appended = new Map(this.#appended)
    for (const k of keys) {
      appended.delete(k)
      replaced.delete(k)
      if (Object.hasOwn(this.#shared.body, k)) dropped.add(k)
    }
    return new BodyView(this.#shared, dropped, replaced, appended)
  }

  /** The body as a plain object (tests, and reads of a whole body). */
  toObject(): Body {
    const out: Body = {}
    for (const k of Object.keys(this.#shared.body)) {
      if (!this.#dropped.has(k)) out[k] = this.#replaced.has(k) ? this.#replaced.get(k) : this.#shared.body[k]
    }
    for (const [k, v] of this.#appended) out[k] = v
    return out
  }

  /**
   * The body's JSON, `JSON.stringify(this.toObject())` byte for byte, as Buffers to send one
   * after another: the shared runs and members, plus this view's own members.
   */
  payload(): Payload {
    const shared = this.#shared
    const chunks: Buffer[] = [OPEN]
    let bytes = 2
    const push = (b: Buffer): void => {
      if (chunks.length > 1) {
        chunks.push(COMMA)
        bytes++
      }
      chunks.push(b)
      bytes += b.length
    }
    const one = (k: string): void => {
      if (this.#dropped.has(k)) return
      if (!this.#replaced.has(k)) {
        if (shared.body[k] !== undefined) push(shared.member(k))
        return
      }
      const v = this.#replaced.get(k)
      if (v !== undefined) push(shared.setMember(k, v))
    }
    for (const seg of shared.segments()) {
      if ('key' in seg) one(seg.key)
      else if (this.#splitsRuns && seg.keys.some((k) => this.#dropped.has(k) || this.#replaced.has(k))) for (const k of seg.keys) one(k)
      else push(seg.run)
    }
    for (const [k, v] of this.#appended) if (v !== undefined) push(shared.setMember(k, v))
    chunks.push(CLOSE)
    return { chunks, bytes }
  }
}

/** A JSON body as Buffers sent one after another (`bytes` in all); the Buffers may be shared. */
export interface Payload {
  chunks: readonly Buffer[]
  bytes: number
}
