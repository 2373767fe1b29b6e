"""HandoffNixlConnector: vLLM's NIXL pull connector that also acts on the router's events.

Everything the stock connector does still happens (it is the parent class, unchanged). On top:

- The scheduler-side connector (one per engine, in the engine core process) follows the
  router's agent event stream (follower.py) and registers the engine: its engine_id, role,
  side-channel address and OpenAI URL.
- Each event is shipped to every worker (every TP rank) in the next step's connector
  metadata, so it is applied on the worker's own thread, where NIXL state may be touched. An
  idle engine is woken for it (vllm_internals.engine_waker), and keeps stepping while events
  wait (has_pending_push_work).
- Workers apply them through vLLM's own paths (vllm_internals): `peer_gone` fails reads in
  flight from the peer, refuses new ones and releases its NIXL state once no read uses it;
  `lease_release` ends P-side leases as the lease reaper would; `peer_alive` lifts a tombstone.
- Workers name the sequences they applied in their worker metadata; vLLM aggregates those over
  all workers before the scheduler sees them, and only then is the router sent an ack.

Why not a follower per worker: a worker's thread of its own may not touch NIXL state while the
engine steps, and an idle engine runs no step to apply anything in. One stream per engine, with
vLLM's metadata broadcast to every rank, gives in-order delivery to all ranks and a wake-up.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .inbox import Command, Inbox
from .metrics import HandoffPromMetrics, HandoffStats
from .settings import load as load_settings
from .vllm_internals import (
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    NixlBaseConnector,
    NixlConnectorMetadata,
    NixlPullConnector,
    NixlPullConnectorScheduler,
    NixlPullConnectorWorker,
    drop_peer,
    engine_waker,
    release_leases,
    side_channel_address,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput

log = logging.getLogger("vllm.handoff")

ROLES = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "both"}
# Tombstones kept per worker (engine_ids declared gone); the oldest go first.
MAX_GONE = 4096


@dataclass
class HandoffWorkerMeta(KVConnectorWorkerMetadata):
    """Worker → scheduler: sequences of router events this worker applied this step."""

    applied: set[int] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, HandoffWorkerMeta):
            # vLLM aggregates once every worker answered the step: a sequence any of them names
            # was shipped to all of them in the same metadata.
            self.applied |= other.applied
        return self


class HandoffPullWorker(NixlPullConnectorWorker):
    """The stock pull worker, plus tombstones for peers the router declared gone."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.xfer_stats = HandoffStats()
        self.gone: dict[str, float] = {}

    def apply(self, commands: list[Command]) -> set[str]:
        """Applies router commands in order; returns P-side requests released now."""
        released: set[str] = set()
        for c in commands:
            if c.kind == "peer_gone":
                for engine_id in c.ids:
                    self.gone[engine_id] = time.monotonic()
                    while len(self.gone) > MAX_GONE:
                        self.gone.pop(next(iter(self.gone)))
                    held, failed = drop_peer(self, engine_id)
                    self.xfer_stats.count("handoff_peers_released", int(held))
                    self.xfer_stats.count("handoff_reads_failed", len(failed))
                    if held or failed:
                        log.info(
                            "handoff: peer_gone %s (seq %d, %s): releasing its NIXL state once "
                            "no read uses it; %d read(s) failed now (rank %d)",
                            engine_id, c.seq, c.reason, len(failed), self.tp_rank,
                        )
            elif c.kind == "peer_alive":
                for engine_id in c.ids:
                    self.gone.pop(engine_id, None)
            elif c.kind == "lease_release":
                now = release_leases(self, c.ids)
                released |= now
                self.xfer_stats.count("handoff_leases_released", len(now))
                if now:
                    log.info(
                        "handoff: lease_release (seq %d, %s): freed the KV of %d request(s) now (rank %d)",
                        c.seq, c.reason, len(now), self.tp_rank,
                    )
                else:
                    log.info(
                        "handoff: lease_release (seq %d, %s): none of its %d request(s) held here "
                        "(read or reaped already) (rank %d)",
                        c.seq, c.reason, len(c.ids), self.tp_rank,
                    )
        return released

    def _read_blocks_for_req(self, req_id: str, meta: Any) -> None:
        # A read from a peer declared gone fails at once, as vLLM fails one from an invalid peer,
        # instead of re-handshaking with a dead address until the handshake times out.
        if meta.remote is not None and meta.remote.engine_id in self.gone:
            self.xfer_stats.count("handoff_reads_failed")
            self._handle_failed_transfer(req_id, None, self._recv_failures, record_failed_transfer=False)
            return
        super()._read_blocks_for_req(req_id, meta)

    def _cleanup_remote_engines(self) -> None:
        # A peer declared gone while a handshake with it was under way: drop_peer found nothing
        # of it to release, and the handshake loaded its agents and metadata afterwards, which
        # vLLM would keep until engine_ttl. Once no handshake runs, such a peer is marked
        # invalid here, so the cleanup below releases it as it does one dropped at once.
        if self.gone:
            self._drop_late_peers()
        super()._cleanup_remote_engines()

    def _drop_late_peers(self) -> None:
        with self._handshake_lock:
            if self._handshake_futures:
                return
            late = [e for e in self._remote_agents if e in self.gone and e not in self._invalid_remote_engines]
        for engine_id in late:
            held, failed = drop_peer(self, engine_id)
            self.xfer_stats.count("handoff_peers_released", int(held))
            self.xfer_stats.count("handoff_reads_failed", len(failed))
            log.info(
                "handoff: peer_gone %s came during a handshake with it: releasing the state the "
                "handshake loaded once no read uses it; %d read(s) failed now (rank %d)",
                engine_id, len(failed), self.tp_rank,
            )

    def _send_heartbeats(self, metadata: NixlConnectorMetadata) -> None:
        # No heartbeat (nor the handshake it would start) to a peer declared gone.
        if self.gone and any(e in self.gone for e in metadata.heartbeat_by_engine):
            metadata.heartbeat_by_engine = {e: hb for e, hb in metadata.heartbeat_by_engine.items() if e not in self.gone}
        super()._send_heartbeats(metadata)


class HandoffNixlConnector(NixlPullConnector):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        # NixlPullConnector.__init__ less the stock worker, which would open a NIXL agent of its
        # own: the worker here is HandoffPullWorker.
        NixlBaseConnector.__init__(self, vllm_config, role, kv_cache_config)
        self._applied: set[int] = set()
        self._inbox: Inbox | None = None
        self._follower: Any = None
        self._stats = HandoffStats()
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = NixlPullConnectorScheduler(vllm_config, self.engine_id, kv_cache_config)
            self._start_follower(vllm_config)
        elif role == KVConnectorRole.WORKER:
            self.connector_worker = HandoffPullWorker(vllm_config, self.engine_id, kv_cache_config)

    # --- scheduler side ---------------------------------------------------------------------

    def _start_follower(self, vllm_config: VllmConfig) -> None:
        from .follower import Follower, Registration

        host, port = side_channel_address(vllm_config)
        settings = load_settings(self.kv_transfer_config.kv_connector_extra_config or {}, host)
        if not settings.router_urls:
            log.warning(
                "handoff: no handoff_router_urls: this engine runs as the stock NixlConnector "
                "and acts on no router event"
            )
            return
        role = ROLES.get(str(self.kv_transfer_config.kv_role), "both")
        bracketed = f"[{host}]" if ":" in host else host
        registration = Registration(
            agent_id=f"vllm-{self.engine_id}",
            engine_id=self.engine_id,
            role=role,
            agent_url=f"http://{bracketed}:{port}",
            engine_url=settings.engine_url,
        )
        self._inbox = Inbox(engine_id=self.engine_id)
        wake = engine_waker()
        if wake is None:
            log.warning("handoff: no engine core loop found to wake: events wait for the next step")
        inbox = self._inbox

        def on_event(event: dict[str, Any]) -> None:
            inbox.put(event)
            if wake is not None:
                wake()

        self._follower = Follower(
            settings.router_urls,
            registration,
            on_event=on_event,
            on_new_log=inbox.new_log,
            token=settings.token,
            keepalive_s=settings.keepalive_s,
        )
        log.info(
            "handoff: engine %s (%s) follows the router's events at %s; side channel %s, engine URL %s",
            self.engine_id, role, ", ".join(settings.router_urls), registration.agent_url, settings.engine_url,
        )
        self._follower.start()

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = super().build_connector_meta(scheduler_output)
        if self._inbox is not None:
            commands = self._inbox.ship()
            if commands:
                meta.handoff_commands = commands
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        super().update_connector_output(connector_output)
        if self._inbox is None:
            return
        worker_meta = connector_output.kv_connector_worker_meta
        if isinstance(worker_meta, HandoffWorkerMeta):
            self._inbox.confirm(worker_meta.applied)
            self._stats.count("handoff_events_applied", len(worker_meta.applied))
        late = self._inbox.expire()
        if late:
            log.warning("handoff: router events %s were not confirmed by every worker in time; acknowledged anyway", late)
        ack = self._inbox.ack()
        if ack is not None:
            self._follower.ack(ack)

    def has_pending_push_work(self) -> bool:
        return super().has_pending_push_work() or (self._inbox is not None and self._inbox.busy())

    def get_kv_connector_stats(self) -> HandoffStats | None:
        if self.connector_worker is not None:
            return super().get_kv_connector_stats()
        return None if self._stats.is_empty() else self._stats.clone_and_reset()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> HandoffStats:
        return HandoffStats(data=data) if data is not None else HandoffStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> HandoffPromMetrics:
        return HandoffPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._follower is not None:
            self._follower.stop()
        super().shutdown()

    # --- worker side ------------------------------------------------------------------------

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        commands: list[Command] = getattr(self._connector_metadata, "handoff_commands", None) or []
        released: set[str] = set()
        if commands:
            assert isinstance(self.connector_worker, HandoffPullWorker)
            try:
                released = self.connector_worker.apply(commands)
            except Exception:  # noqa: BLE001 - a failed event must not take the engine down
                log.exception("handoff: applying router events failed")
            self._applied.update(c.seq for c in commands)
        results = super().get_transfer_results(finished_req_ids)
        if released:
            results.finished_sending |= released
        return results

    def build_connector_worker_meta(self) -> HandoffWorkerMeta | None:
        if not self._applied:
            return None
        applied, self._applied = self._applied, set()
        return HandoffWorkerMeta(applied=applied)
