#!/usr/bin/env node
// Sums a HANDOFF_TEST_CPU_LOG file (test/setup/cpu-account.ts): CPU seconds per test folder and
// the heaviest files. Usage: node scripts/test-cpu-summary.mjs FILE [top=25]
import { readFileSync } from 'node:fs'

const [file, top = '25'] = process.argv.slice(2)
if (!file) {
  console.error('usage: node scripts/test-cpu-summary.mjs FILE [top]')
  process.exit(2)
}
const rows = readFileSync(file, 'utf8').split('\n').filter(Boolean).map((line) => JSON.parse(line))
const folders = new Map()
let self = 0
let children = 0
for (const r of rows) {
  const folder = r.file.split('/').slice(0, 2).join('/')
  const f = folders.get(folder) ?? { files: 0, self: 0, children: 0, wall: 0 }
  f.files++
  f.self += r.selfCpuS
  f.children += r.childrenCpuS
  f.wall += r.wallS
  folders.set(folder, f)
  self += r.selfCpuS
  children += r.childrenCpuS
}
const s = (n) => n.toFixed(0).padStart(6)
console.log(`${rows.length} files: ${s(self + children)} CPU-s (test processes ${s(self)}, their children ${s(children)})\n`)
console.log('folder                     files  CPU-s   self  children  sum of wall-s')
for (const [name, f] of [...folders].sort((a, b) => b[1].self + b[1].children - a[1].self - a[1].children)) {
  console.log(`${name.padEnd(26)} ${String(f.files).padStart(5)} ${s(f.self + f.children)} ${s(f.self)} ${s(f.children)}    ${s(f.wall)}`)
}
console.log('\nCPU-s   self  children  wall-s  file')
for (const r of rows.sort((a, b) => b.selfCpuS + b.childrenCpuS - a.selfCpuS - a.childrenCpuS).slice(0, Number(top))) {
  console.log(`${s(r.selfCpuS + r.childrenCpuS)} ${s(r.selfCpuS)} ${s(r.childrenCpuS)}  ${s(r.wallS)}  ${r.file}`)
}
