#!/usr/bin/env node
// Runs the bundled CLI (`npm run build` writes dist/handoff.js).
import '../dist/handoff.js'
