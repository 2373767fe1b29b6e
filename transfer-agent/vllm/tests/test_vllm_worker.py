"""The connector's worker side on vLLM 0.32's own worker methods (needs vLLM: skipped without).

As vLLM's connector unit tests build a scheduler without its __init__, the worker here is made
with object.__new__ and only the state the event paths touch, over a fake NIXL wrapper that
records what it is asked to release. What runs is vLLM's code: `_handle_failed_transfer`,
`_mark_remote_engine_invalid`, `_cleanup_remote_engines`, `_cleanup_remote_engine`. If a
vLLM release renames that state, these tests fail first, which is the point: vllm_internals.py
is the module to port.
"""

from __future__ import annotations

import threading
import time
import unittest
from collections import defaultdict
from typing import Any

try:
    import vllm  # noqa: F401

    HAVE_VLLM = True
except ImportError:
    HAVE_VLLM = False


class FakeNixl:
    def __init__(self, busy_handles: set[int] | None = None) -> None:
        self.released: list[int] = []
        self.removed_agents: list[str] = []
        self.busy = busy_handles or set()

    def release_xfer_handle(self, handle: int) -> None:
        if handle in self.busy:
            raise RuntimeError("NIXL_ERR_REPOST_ACTIVE")
        self.released.append(handle)

    def release_dlist_handle(self, handle: int) -> None:
        pass

    def remove_remote_agent(self, name: str) -> None:
        self.removed_agents.append(name)

    def check_remote_metadata(self, name: str) -> bool:
        return True


@unittest.skipUnless(HAVE_VLLM, "needs vLLM")
class WorkerEventsTest(unittest.TestCase):
    def worker(self, nixl: FakeNixl) -> Any:
        from handoff_vllm.connector import HandoffPullWorker
        from handoff_vllm.metrics import HandoffStats

        w = object.__new__(HandoffPullWorker)
        w.nixl_wrapper = nixl
        w.engine_id = "d-0"
        w.tp_rank = 0
        w.gone = {}
        w.xfer_stats = HandoffStats()
        w._recving_transfers = defaultdict(list)
        w._recving_metadata = {}
        w._recv_failures = set()
        w._failed_remote_engines = set()
        w._invalid_remote_engines = set()
        w._invalid_engine_backoff = {}
        w._handshake_lock = threading.RLock()
        w._handshake_futures = {}
        w._remote_agents = defaultdict(dict)
        w._engine_by_address = {}
        w._engine_last_active = {}
        w._engine_clock_offset = {}
        w.transfer_topo = None
        for name in ("dst_xfer_side_handles", "kv_caches_base_addr", "dst_num_blocks", "dst_region_num_blocks", "dst_region_group_ids", "dst_uses_region_group_mapping", "dst_region_mem_types", "tp_mappings"):
            setattr(w, name, {})
        w._reqs_to_send = {}
        w._reqs_to_process = set()
        w.consumer_notification_counts_by_req = defaultdict(int)
        w.expected_consumer_notifications_by_req = {}
        return w

    def meta(self, req_id: str, engine_id: str) -> Any:
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import RemoteMeta, ReqMeta

        remote = RemoteMeta(block_ids=([1, 2],), host="10.0.0.1", port=5600, engine_id=engine_id, request_id=f"p-{req_id}")
        return ReqMeta(local_block_ids=([3, 4],), local_physical_block_ids=([3, 4],), tp_size=1, remote=remote)

    def reading(self, w: Any, req_id: str, engine_id: str, handles: list[int]) -> None:
        w._recving_metadata[req_id] = self.meta(req_id, engine_id)
        w._recving_transfers[req_id] = list(handles)

    def gone(self, seq: int, *ids: str) -> Any:
        from handoff_vllm.inbox import Command

        return Command(seq, "peer_gone", list(ids), "test")

    def test_peer_gone_fails_its_reads_and_vllm_releases_the_peer_once_they_drained(self) -> None:
        nixl = FakeNixl(busy_handles={12})
        w = self.worker(nixl)
        w._remote_agents["p-1"] = {(0, 0): "agent-p1"}
        w._engine_by_address[("10.0.0.1", 5600)] = "p-1"
        w._remote_agents["p-2"] = {(0, 0): "agent-p2"}
        self.reading(w, "r-done", "p-1", [11])  # its handle can be released now
        self.reading(w, "r-busy", "p-1", [12])  # NIXL refuses: the handle stays, polled as before
        self.reading(w, "r-other", "p-2", [21])
        w.apply([self.gone(1, "p-1")])
        self.assertEqual(nixl.released, [11])
        self.assertIn("r-done", w._recv_failures)
        self.assertNotIn("r-done", w._recving_transfers, "no handle left: reported failed this step")
        self.assertEqual(w._recving_transfers["r-busy"], [12])
        self.assertEqual(w._recving_transfers["r-other"], [21], "another peer's read is untouched")
        self.assertIn("p-1", w._invalid_remote_engines, "vLLM's invalid-peer path")
        self.assertEqual(sum(w.xfer_stats.data["handoff_reads_failed"]), 2)
        self.assertEqual(sum(w.xfer_stats.data["handoff_peers_released"]), 1)
        # vLLM's cleanup at the end of the step: not while a READ still runs against the peer.
        w._cleanup_remote_engines()
        self.assertIn("p-1", w._remote_agents)
        del w._recving_transfers["r-busy"]
        w._cleanup_remote_engines()
        self.assertNotIn("p-1", w._remote_agents, "released once no read uses it")
        self.assertEqual(nixl.removed_agents, ["agent-p1"])
        self.assertNotIn(("10.0.0.1", 5600), w._engine_by_address)
        self.assertIn("p-2", w._remote_agents)

    def test_a_tombstoned_peer_fails_reads_at_once_until_it_is_alive_again(self) -> None:
        from handoff_vllm.inbox import Command

        w = self.worker(FakeNixl())
        w.apply([self.gone(1, "p-unknown")])
        self.assertEqual(w.xfer_stats.data["handoff_peers_released"], [], "an unknown peer: nothing held, nothing released")
        meta = self.meta("r1", "p-unknown")
        w._recving_metadata["r1"] = meta
        w._read_blocks_for_req("r1", meta)
        self.assertIn("r1", w._recv_failures, "failed at once, no handshake with a gone peer")
        w.apply([Command(2, "peer_alive", ["p-unknown"])])
        self.assertNotIn("p-unknown", w.gone)

    def test_a_peer_gone_during_a_handshake_is_released_once_the_handshake_loaded_it(self) -> None:
        from concurrent.futures import Future

        nixl = FakeNixl()
        w = self.worker(nixl)
        # D is handshaking with p-1 (a request waits on it) when the router says it is gone.
        w._handshake_futures["p-1"] = Future()
        w.apply([self.gone(1, "p-1")])
        self.assertEqual(sum(w.xfer_stats.data["handoff_peers_released"]), 0, "nothing held yet")
        w._cleanup_remote_engines()
        self.assertEqual(nixl.removed_agents, [], "nothing to release while the handshake runs")
        # The handshake ends and loads p-1's agents (vLLM's done_callback), after the tombstone.
        with w._handshake_lock:
            del w._handshake_futures["p-1"]
            w._remote_agents["p-1"] = {(0, 0): "agent-p1"}
            w._engine_by_address[("10.0.0.1", 5600)] = "p-1"
        # The request that waited on it reads now: the tombstone fails it at once.
        meta = self.meta("r1", "p-1")
        w._recving_metadata["r1"] = meta
        w._read_blocks_for_req("r1", meta)
        self.assertIn("r1", w._recv_failures)
        del w._recving_metadata["r1"]
        # The step's cleanup releases what the handshake loaded, not engine_ttl later.
        w._cleanup_remote_engines()
        self.assertNotIn("p-1", w._remote_agents)
        self.assertEqual(nixl.removed_agents, ["agent-p1"])
        self.assertEqual(sum(w.xfer_stats.data["handoff_peers_released"]), 1)
        w._cleanup_remote_engines()
        self.assertEqual(nixl.removed_agents, ["agent-p1"], "released once")

    def test_lease_release_ends_p_leases_as_the_reaper_would(self) -> None:
        from handoff_vllm.inbox import Command

        w = self.worker(FakeNixl())
        w._reqs_to_send = {"r1": time.perf_counter() + 30, "r2": time.perf_counter() + 30}
        w._reqs_to_process = {"r1", "r2"}
        w.consumer_notification_counts_by_req["r1"] = 0
        released = w.apply([Command(3, "lease_release", ["r1", "not-here"])])
        self.assertEqual(released, {"r1"})
        self.assertEqual(set(w._reqs_to_send), {"r2"})
        self.assertEqual(w._reqs_to_process, {"r2"})
        self.assertEqual(sum(w.xfer_stats.data["handoff_leases_released"]), 1)


if __name__ == "__main__":
    unittest.main()
