/** One request as the simulator received it, for tests that assert what the router sent. */
export interface RecordedRequest {
  seq: number
  receivedAt: number
  method: string
  path: string
  headers: Record<string, string | string[] | undefined>
  body: unknown
}

/** A ring of the last `capacity` requests (oldest first when listed). */
export class RequestLog {
  readonly #capacity: number
  #items: RecordedRequest[] = []
  #seq = 0

  constructor(capacity = 100) {
    this.#capacity = capacity
  }

  add(entry: Omit<RecordedRequest, 'seq'>): void {
    this.#items.push({ seq: ++this.#seq, ...entry })
    if (this.#items.length > this.#capacity) this.#items.shift()
  }

  list(): RecordedRequest[] {
    return [...this.#items]
  }

  clear(): void {
    this.#items = []
  }
}
