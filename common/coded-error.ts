import createError from '@fastify/error'

/**
 * One way to build every package's table of coded errors (router RTR_ERR_*, simulator
 * SIM_ERR_*, native NAT_ERR_*, transfer agent XFA_ERR_*), on @fastify/error: a spec object
 * `{CODE: {status, message, ...extra}}` becomes `{CODE: constructor}`, so the exported names
 * equal the codes, `err.code` is the key and `err.statusCode` the status. The message is a
 * util.format template filled from the constructor's arguments; a last argument
 * `{cause}` becomes `err.cause` (@fastify/error's rule). Extra spec fields (the router's
 * OpenAI `type`, say) are readable on every instance, non-enumerable, and on `Ctor.spec`.
 */

export interface ErrorSpec {
  /** The HTTP status a service answers with (or, outside HTTP, how it surfaces the failure). */
  readonly status: number
  /** A util.format template: `%s`, `%d` filled from the constructor's arguments in order. */
  readonly message: string
}

export type ErrorSpecs = Readonly<Record<string, ErrorSpec>>

/** The fields of a spec beyond status and message. */
export type ErrorExtras<S extends ErrorSpec> = Omit<S, 'status' | 'message'>

/** An instance built by a table's constructor. */
export type CodedError<C extends string = string, S extends ErrorSpec = ErrorSpec> = createError.FastifyError & {
  code: C
  statusCode: S['status']
} & Readonly<ErrorExtras<S>>

export interface CodedErrorConstructor<C extends string = string, S extends ErrorSpec = ErrorSpec, A extends unknown[] = unknown[]> {
  new (...args: A): CodedError<C, S>
  (...args: A): CodedError<C, S>
  readonly prototype: CodedError<C, S>
  readonly code: C
  readonly spec: S
}

/** `{CODE: constructor}`; `A` types the constructors' arguments (the same for the whole table). */
export type ErrorTable<S extends ErrorSpecs, A extends unknown[] = unknown[]> = {
  readonly [C in keyof S & string]: CodedErrorConstructor<C, S[C], A>
}

// Set by the constructor or by Error itself; a spec extra of that name would be shadowed.
const RESERVED = new Set(['code', 'statusCode', 'name', 'message', 'cause', 'stack', 'constructor', 'toString'])

/**
 * Builds a table of coded error constructors from `specs`. Give `A` to type the arguments,
 * e.g. `codedErrors<typeof specs, [detail: string, options?: { cause?: unknown }]>(specs)`.
 * Throws on a code that is not upper snake case, a status that is not an integer, or an
 * extra field that an error instance already has.
 */
export function codedErrors<const S extends ErrorSpecs, A extends unknown[] = unknown[]>(specs: S): ErrorTable<S, A> {
  const table: Record<string, unknown> = {}
  for (const [code, spec] of Object.entries(specs)) {
    // @fastify/error upper-cases codes; a key it would change could not equal its code.
    if (!/^[A-Z][A-Z0-9_]*$/.test(code)) throw new TypeError(`error code ${code} must be UPPER_SNAKE_CASE`)
    if (!Number.isInteger(spec.status)) throw new TypeError(`${code}: status must be an integer`)
    const Ctor = createError(code, spec.message, spec.status)
    for (const [key, value] of Object.entries(spec)) {
      if (key === 'status' || key === 'message') continue
      if (RESERVED.has(key)) throw new TypeError(`${code}: spec field ${key} is reserved`)
      Object.defineProperty(Ctor.prototype, key, { value, enumerable: false })
    }
    Object.defineProperty(Ctor, 'code', { value: code, enumerable: true })
    Object.defineProperty(Ctor, 'spec', { value: Object.freeze({ ...spec }), enumerable: true })
    table[code] = Ctor
  }
  return Object.freeze(table) as ErrorTable<S, A>
}

/**
 * `codedErrors` with the constructors' arguments typed and the specs still inferred:
 * `codedErrorsWith<[detail: string, options?: { cause?: unknown }]>()({ NAT_ERR_X: {...} })`.
 */
export function codedErrorsWith<A extends unknown[]>(): <const S extends ErrorSpecs>(specs: S) => ErrorTable<S, A> {
  return (specs) => codedErrors<typeof specs, A>(specs)
}

/** Every code of a table, in declaration order (for consistency tests and docs checks). */
export function errorCodes(table: Readonly<Record<string, { readonly code: string }>>): string[] {
  return Object.values(table).map((ctor) => ctor.code)
}

/** Whether `err` was built by one of `table`'s constructors (by its code). */
// `never` arguments: a table whose constructors take typed arguments (codedErrorsWith) fits too.
export function isTableError<T extends Readonly<Record<string, CodedErrorConstructor<string, ErrorSpec, never>>>>(
  table: T,
  err: unknown,
): err is CodedError<keyof T & string> {
  if (!(err instanceof Error)) return false
  const code = (err as { code?: unknown }).code
  return typeof code === 'string' && Object.hasOwn(table, code) && err instanceof (table[code] as CodedErrorConstructor<string, ErrorSpec, never>)
}

/**
 * `new table[code](detail, {cause})`, with every defined field of `details` set on the error:
 * the packages whose errors carry context (native's NIXL status, the agent's peer) share it.
 */
export function errorWithDetails<D extends object>(
  table: Readonly<Record<string, new (detail: string, options?: { cause?: unknown }) => Error>>,
  code: string,
  detail: string,
  extra: D & { cause?: unknown },
): Error & Partial<D> {
  const { cause, ...details } = extra
  const Ctor = table[code]
  if (!Ctor) throw new TypeError(`unknown error code ${code}`)
  const err = cause === undefined ? new Ctor(detail) : new Ctor(detail, { cause })
  for (const [key, value] of Object.entries(details)) if (value !== undefined) Reflect.set(err, key, value)
  return err as Error & Partial<D>
}

/** Codes that appear in more than one of `tables`: a cross-package consistency check. */
export function duplicateCodes(...tables: readonly Readonly<Record<string, { readonly code: string }>>[]): string[] {
  const seen = new Set<string>()
  const dup = new Set<string>()
  for (const table of tables) {
    for (const code of errorCodes(table)) {
      if (seen.has(code)) dup.add(code)
      seen.add(code)
    }
  }
  return [...dup]
}
