"""vLLM-style metrics for applied router events, on vLLM's own connector-stats path.

Workers and the scheduler-side connector count into a `NixlKVConnectorStats` subclass; vLLM
aggregates those per step and hands them to the API server, where `HandoffPromMetrics` adds
its counters beside NIXL's on `/metrics`:

    vllm:handoff_events_applied_total     router events every worker applied
    vllm:handoff_peers_released_total     gone peers whose NIXL state a worker released
    vllm:handoff_reads_failed_total       reads failed at once because their peer was gone
    vllm:handoff_leases_released_total    P-side leases the router ended before their TTL
"""

from __future__ import annotations

from typing import Any

from .vllm_internals import NixlKVConnectorStats, NixlPromMetrics, create_metric_per_engine

COUNTERS = {
    "handoff_events_applied": "Router events (peer_gone, peer_alive, lease_release) applied by every worker.",
    "handoff_peers_released": "Gone peers whose NIXL state a worker released on the router's word.",
    "handoff_reads_failed": "KV reads failed at once because the router declared their peer gone.",
    "handoff_leases_released": "P-side KV leases the router released before kv_lease_duration.",
}


class HandoffStats(NixlKVConnectorStats):
    def reset(self) -> None:
        super().reset()
        for key in COUNTERS:
            self.data[key] = []

    def count(self, key: str, n: int = 1) -> None:
        if n > 0:
            self.data[key].append(n)

    def is_empty(self) -> bool:
        return super().is_empty() and not any(self.data.get(k) for k in COUNTERS)

    def reduce(self) -> dict[str, int | float]:
        out = super().reduce()
        for key in COUNTERS:
            if self.data.get(key):
                out[key] = sum(self.data[key])
        return out


class HandoffPromMetrics(NixlPromMetrics):
    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.handoff = {
            key: create_metric_per_engine(
                self._counter_cls(name=f"vllm:{key}", documentation=doc, labelnames=labelnames),
                self.per_engine_labelvalues,
            )
            for key, doc in COUNTERS.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        super().observe(transfer_stats_data, engine_idx)
        for key, counter in self.handoff.items():
            for n in transfer_stats_data.get(key, ()):
                counter[engine_idx].inc(n)
