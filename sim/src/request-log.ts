/** One request as the simulator received it, for tests that assert what the router sent. */
export interface RecordedRequest {
  seq: number
  receivedAt: number
  method: string
  path: string
  /** The X-Request-Id header it came with (null without one): what id the router sent. */
  xRequestId: string | null
  headers: Record<string, string | string[] | undefined>
  body: unknown
  /** Set once a completion is served: how it finished and the params it answered with. */
  finishReason?: string
  stopReason?: string | number | null
  kvTransferParams?: Record<string, unknown> | null
  /** `--kv agent` decode legs: how the KV arrived, and the agent's code when a pull failed. */
  kvLoad?: 'ok' | 'failed' | 'recomputed'
  kvLoadError?: string
}

export type RequestOutcome = Partial<Pick<RecordedRequest, 'finishReason' | 'stopReason' | 'kvTransferParams' | 'kvLoad' | 'kvLoadError'>>

/** A ring of the last `capacity` requests (oldest first when listed). */
export class RequestLog {
  readonly #capacity: number
  #items: RecordedRequest[] = []
  #seq = 0
  // Entry per in-flight request object, so a route can record how its request ended.
  readonly #byKey = new WeakMap<object, RecordedRequest>()

  constructor(capacity = 100) {
    this.#capacity = capacity
  }

  add(entry: Omit<RecordedRequest, 'seq'>, key?: object): void {
    const recorded = { seq: ++this.#seq, ...entry }
    this.#items.push(recorded)
    if (key) this.#byKey.set(key, recorded)
    if (this.#items.length > this.#capacity) this.#items.shift()
  }

  /** Adds the outcome to the entry recorded under `key`; a no-op if it was never recorded. */
  annotate(key: object, outcome: RequestOutcome): void {
    const entry = this.#byKey.get(key)
    if (entry) Object.assign(entry, outcome)
  }

  list(): RecordedRequest[] {
    return this.#items.map((e) => ({ ...e }))
  }

  clear(): void {
    this.#items = []
  }
}
