import AjvCompiler from '@fastify/ajv-compiler'
import SerializerSelector from '@fastify/fast-json-stringify-compiler'

/*
 * Fastify compiles every route's schemas each time an app is built: ajv for what a route
 * validates, fast-json-stringify for what it answers. Its default compilers keep their pools
 * per app, so a process that builds several apps (a test file: one per case) compiles the same
 * schema objects again each time, and one app compiles a response schema shared by several
 * routes once per route. Measured with --cpu-prof (Node 24, in-process test files run without
 * tap): ajv and fast-json-stringify were 1.0 of 2.9 busy CPU-s in test/router/read-check and
 * 1.3 of 3.6 in test/router/vllm-compat.
 *
 * These compilers are fastify's own, with their pools kept per process: one Ajv per set of
 * shared schemas and options (as fastify keys it; Ajv itself caches a compiled schema by its
 * object), and one serializer per (shared schemas, options, response schema object). Route
 * schemas are module constants, so the same object means the same schema. Only the headers
 * part compiles differently under a custom compiler (fastify does not lower-case its property
 * names then); no route's headers schema names a property (sim/src/routes/sim-admin.ts has
 * the only one, an empty object).
 */
const buildValidator = AjvCompiler()
const serializerFactory = SerializerSelector()
const serializerPools = new Map<string, WeakMap<object, SerializerSelector.Serializer>>()

const buildSerializer: SerializerSelector.SerializerFactory = (externalSchemas, options) => {
  const key = `${JSON.stringify(externalSchemas ?? {})}${JSON.stringify(options ?? {})}`
  const pool = serializerPools.get(key) ?? new WeakMap<object, SerializerSelector.Serializer>()
  serializerPools.set(key, pool)
  const compile = serializerFactory(externalSchemas, options)
  return (route) => {
    const schema = route.schema as object
    let serialize = pool.get(schema)
    if (!serialize) pool.set(schema, (serialize = compile(route)))
    return serialize
  }
}

/** Fastify's `schemaController` option: its compilers, pooled per process. */
export const processSchemaController = { compilersFactory: { buildValidator, buildSerializer } }
