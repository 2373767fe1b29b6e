#!/usr/bin/env node
// Runs the compiled CLI (`npm run build` writes dist/).
import '../dist/cli/main.js'
