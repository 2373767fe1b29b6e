"""Loaded at the start of every Python process of a test or bench vLLM engine (PYTHONPATH).

NIXL's Python agent sets its progress thread's delay to 0 (``nixl_agent.__init__``:
``agent_config.pthrDelay = 0``) and vLLM exposes no way to change it, so each engine's UCX
progress thread busy-polls (``poll(..., 0)``): a whole core per idle engine. On the 2-core
machines the tests run on, that takes half the CPU from the engines' own work. Here the delay
becomes HANDOFF_NIXL_PROGRESS_DELAY_US, the thread's poll timeout. Measured, not read in NIXL's
source: the vLLM test files ran faster with it, so transfers did not wait on the timeout. Nothing else in NIXL or vLLM changes.
"""

import importlib.abc
import importlib.machinery
import os
import sys

_DELAY_US = int(os.environ.get("HANDOFF_NIXL_PROGRESS_DELAY_US", "0") or "0")
_TARGETS = {"nixl_cu12._bindings", "nixl_cu13._bindings"}


def _patch(module):
    base = module.nixlAgentConfig

    class _AgentConfig(base):
        @property
        def pthrDelay(self):
            return base.pthrDelay.__get__(self)

        @pthrDelay.setter
        def pthrDelay(self, value):
            base.pthrDelay.__set__(self, max(int(value), _DELAY_US))

    module.nixlAgentConfig = _AgentConfig
    # In the engine's log, so a test can tell the hook still applies after an upgrade.
    print(f"handoff: NIXL progress thread delay {_DELAY_US} us ({module.__name__})", file=sys.stderr, flush=True)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in _TARGETS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _patch(module)

        loader.exec_module = exec_and_patch
        return spec


if _DELAY_US > 0:
    sys.meta_path.insert(0, _Finder())
