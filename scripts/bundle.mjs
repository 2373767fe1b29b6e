#!/usr/bin/env node
// `npm run build`, second step: bundles tsc's output (dist/cli/main.js) and the dependencies it
// imports into dist/handoff.js and its chunks (dist/chunks/), the CLI that every handoff process
// runs: bin/handoff.js, the image, `handoff up`, the benches and the tests' children.
//
// Why: Node resolves and compiles every file a process imports, and a router or simulator
// imports about 600 (fastify, ajv, pino, undici, ...). Bundled, a simulator starts on about half
// the CPU (docs/testing.md). Dynamic imports stay lazy: each is a chunk of its own, loaded only
// when the command needs it (the Kubernetes client only with discovery; test/cli/lazy-load.test.ts
// holds the bundle to it through dist/bundle-meta.json, which says what each chunk holds).
import { rmSync, writeFileSync } from 'node:fs'
import { dirname, join } from 'node:path'
import { fileURLToPath } from 'node:url'
import { build } from 'esbuild'

const packageRoot = dirname(dirname(fileURLToPath(import.meta.url)))

const dist = join(packageRoot, 'dist')
rmSync(join(dist, 'chunks'), { recursive: true, force: true })

const result = await build({
  absWorkingDir: packageRoot,
  entryPoints: { handoff: 'dist/cli/main.js' },
  outdir: 'dist',
  chunkNames: 'chunks/[name]-[hash]',
  bundle: true,
  splitting: true,
  format: 'esm',
  platform: 'node',
  target: 'node22',
  // zeromq finds its prebuilt addon from its own folder (node-gyp-build, __dirname): it stays
  // a package that Node loads from node_modules.
  external: ['zeromq'],
  // The CommonJS dependencies call require() for Node's modules, and a few name __dirname on
  // paths handoff does not take (pino's transports, ioredis's friendly stacks); an ES module has
  // neither.
  banner: {
    js: [
      "import { createRequire as __handoffRequire } from 'node:module';",
      "import { fileURLToPath as __handoffPath } from 'node:url';",
      'const require = __handoffRequire(import.meta.url);',
      'const __filename = __handoffPath(import.meta.url);',
      "const __dirname = __handoffPath(new URL('.', import.meta.url));",
    ].join(' '),
  },
  sourcemap: 'linked',
  metafile: true,
  logLevel: 'warning',
})
writeFileSync(join(dist, 'bundle-meta.json'), JSON.stringify(result.metafile))
