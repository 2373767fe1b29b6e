/**
 * A Set that keeps at most `capacity` values: past it the oldest goes first, and adding a
 * value already held makes it the newest. For what the router remembers about things callers
 * name (engine_ids seen), which must not grow with them (DESIGN "Security").
 */
export class BoundedSet<T> implements Iterable<T> {
  readonly #capacity: number
  readonly #values = new Set<T>()

  constructor(capacity: number) {
    if (!(Number.isInteger(capacity) && capacity > 0)) throw new RangeError(`capacity must be a positive integer, got ${capacity}`)
    this.#capacity = capacity
  }

  get size(): number {
    return this.#values.size
  }

  add(value: T): this {
    this.#values.delete(value)
    this.#values.add(value)
    if (this.#values.size > this.#capacity) this.#values.delete(this.#values.values().next().value as T)
    return this
  }

  delete(value: T): boolean {
    return this.#values.delete(value)
  }

  has(value: T): boolean {
    return this.#values.has(value)
  }

  [Symbol.iterator](): Iterator<T> {
    return this.#values.values()
  }
}
