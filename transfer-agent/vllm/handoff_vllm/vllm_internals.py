"""Everything handoff_vllm knows about vLLM's insides, in one module.

The connector reuses vLLM's own NIXL pull connector and its own paths for the two things the
router's events ask for:

- a peer that is gone: vLLM's invalid-peer path (``_mark_remote_engine_invalid``), which
  rejects new reads at once and releases the peer's NIXL state in ``_cleanup_remote_engines``
  once no read uses it;
- a lease the router releases: what the lease reaper (``_reap_expired_send_leases``) does to an
  expired lease, so the blocks go back through ``finished_sending``.

Those are private names of vLLM 0.32, so this module pins the versions it was written and
tested against (``SUPPORTED``) and refuses any other at start-up with a clear message instead
of failing later, mid-request. When vLLM moves, this file is the one to port.
"""

from __future__ import annotations

import queue
import sys
import time
from typing import Any, Callable

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

# Kept equal to the range in pyproject.toml's optional dependencies.
SUPPORTED = SpecifierSet(">=0.32.0,<0.33")


class UnsupportedVllm(RuntimeError):
    pass


def check_version() -> str:
    """vLLM's version, or UnsupportedVllm naming the supported range."""
    import vllm

    raw = getattr(vllm, "__version__", "unknown")
    try:
        version = Version(raw)
    except InvalidVersion:
        version = None
    # A local build tag (0.32.0+cpu) is the same release.
    if version is None or Version(version.base_version) not in SUPPORTED:
        raise UnsupportedVllm(
            f"handoff_vllm supports vLLM {SUPPORTED} and this is vLLM {raw}. Use vLLM's own "
            "NixlConnector here (the router then falls back to its engine-mode URL template), "
            "or a handoff_vllm release made for this vLLM."
        )
    return raw


check_version()

# Imported only once the version is known to have them.
from vllm import envs  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import (  # noqa: E402
    NixlBaseConnector,
    NixlConnectorMetadata,
    NixlKVConnectorStats,
    NixlPullConnector,
    NixlPullConnectorScheduler,
    NixlPullConnectorWorker,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import (  # noqa: E402
    NixlPromMetrics,
)
from vllm.v1.metrics.utils import create_metric_per_engine  # noqa: E402

__all__ = [
    "KVConnectorRole",
    "KVConnectorWorkerMetadata",
    "NixlBaseConnector",
    "NixlConnectorMetadata",
    "NixlKVConnectorStats",
    "NixlPromMetrics",
    "NixlPullConnector",
    "NixlPullConnectorScheduler",
    "NixlPullConnectorWorker",
    "create_metric_per_engine",
    "drop_peer",
    "engine_waker",
    "release_leases",
    "side_channel_address",
    "UnsupportedVllm",
]


def side_channel_address(vllm_config: Any) -> tuple[str, int]:
    """Where D workers handshake with this engine: what P's answers call remote_host:port."""
    port = envs.VLLM_NIXL_SIDE_CHANNEL_PORT + vllm_config.parallel_config.data_parallel_index
    return envs.VLLM_NIXL_SIDE_CHANNEL_HOST, port


def engine_waker() -> Callable[[], None] | None:
    """A call that wakes the engine core's idle loop, or None where there is none.

    An idle vLLM engine blocks on its input queue and runs no step, so an event for it would
    wait for the next request. The scheduler-side connector is built inside the engine core's
    constructor, after the core made its input queue: this finds that queue up the stack and
    returns a call that puts vLLM's own WAKEUP sentinel on it. The loop then asks
    ``has_pending_push_work`` and runs one step, in which the workers apply the event.
    """
    from vllm.v1.engine import EngineCoreRequestType

    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        q = getattr(owner, "input_queue", None)
        if isinstance(q, queue.Queue) and type(owner).__name__.startswith("EngineCore"):
            return lambda: q.put_nowait((EngineCoreRequestType.WAKEUP, None))
        frame = frame.f_back
    return None


def drop_peer(worker: NixlPullConnectorWorker, engine_id: str) -> tuple[bool, list[str]]:
    """Releases a gone peer through vLLM's invalid-peer path, on the worker's own thread.

    Reads in flight from it are failed now (their handles released where NIXL allows; one it
    still holds stays and is polled as before), which makes their requests fail this step
    instead of when the transport gives up. Then the peer is marked invalid, so vLLM's
    ``_cleanup_remote_engines`` (run at the end of this same step) releases its NIXL agents,
    descriptors and cached metadata once nothing reads from it.

    Returns whether this worker held state for the peer, and the requests whose reads failed.
    """
    failed: list[str] = []
    for req_id, handles in list(worker._recving_transfers.items()):
        meta = worker._recving_metadata.get(req_id)
        if meta is None or meta.remote is None or meta.remote.engine_id != engine_id:
            continue
        kept = [
            h
            for h in handles
            if not worker._handle_failed_transfer(
                req_id, h, worker._recv_failures, record_failed_transfer=False
            )
        ]
        if kept:
            worker._recving_transfers[req_id] = kept
        else:
            # Reported as failed by get_transfer_results: no handle left, listed in _recv_failures.
            worker._recving_transfers.pop(req_id, None)
            worker._recv_failures.add(req_id)
        failed.append(req_id)
    # _cleanup_remote_engine asserts the peer is known: mark only one this worker handshook with.
    with worker._handshake_lock:
        held = engine_id in worker._remote_agents
    if held:
        worker._mark_remote_engine_invalid(engine_id, time.perf_counter())
    return held, failed


def release_leases(worker: NixlPullConnectorWorker, request_ids: list[str]) -> set[str]:
    """Ends P-side leases now, as the lease reaper ends an expired one.

    The returned requests are to be reported in this step's ``finished_sending``, which is how
    the scheduler frees their blocks. Unknown ids (already read, already reaped, another
    engine's) are skipped.
    """
    released: set[str] = set()
    for req_id in request_ids:
        if req_id not in worker._reqs_to_send:
            continue
        worker.consumer_notification_counts_by_req.pop(req_id, None)
        worker.expected_consumer_notifications_by_req.pop(req_id, None)
        worker._reqs_to_process.discard(req_id)
        del worker._reqs_to_send[req_id]
        released.add(req_id)
    return released

