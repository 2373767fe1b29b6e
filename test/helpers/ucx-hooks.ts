// UCX's memory hooks, for every test process that makes NIXL agents and every child it starts
// (they inherit the environment). Import this before anything that loads NIXL.
//
// UCX installs hooks on the mmap family so its registration cache hears of unmapped memory.
// Both ways of installing them have failed here under the suite's load, never alone:
// - in place ("bistro", UCX's default): a test process or target crashed around its first
//   UCX context with a corrupt malloc heap, about 4 runs in 10 at -j 4 twice at once;
// - through the relocation tables ("reloc"): a target hung for good in init, a libuv worker
//   inside UCX's sbrk hook waiting on the dynamic loader's lock (dlclose) while the thread
//   that held it waited on that worker (gdb stacks in docs/native.md, "Known").
// The tests read DRAM over tcp, shared memory and CMA, where nothing registers memory through
// that cache, so they run with no hooks at all. An environment that sets the mode keeps it.
process.env.UCX_MEM_MMAP_HOOK_MODE ??= 'none'
