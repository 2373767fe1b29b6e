"""Router events on their way from the follower thread to every worker of one engine.

The follower (a thread in the engine core process) puts each event here as it arrives. The
scheduler-side connector ships what is pending in the next step's connector metadata, which
vLLM hands to every worker (every TP rank); each worker applies them on its own thread and
names their sequences in its worker metadata; vLLM aggregates that over all workers before the
scheduler sees it, so a sequence confirmed there was applied by every rank. Only then is it
acknowledged to the router.

Acknowledgements are cumulative (the router's ack means "everything up to seq"), so the inbox
acknowledges the longest prefix of sequences that were confirmed or concerned no worker.

No vLLM import here: it is tested on its own.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class Command:
    """What workers do for one event: one of the three kinds, with its ids."""

    seq: int
    kind: str  # "peer_gone" | "peer_alive" | "lease_release"
    ids: list[str]
    reason: str = ""


@dataclass
class _Entry:
    seq: int
    epoch: int
    command: Command | None  # None: no worker action (another engine's lease)
    shipped_at: float | None = None
    done: bool = False


@dataclass
class Inbox:
    """Thread-safe: `put` runs on the follower's thread, the rest on the scheduler's."""

    engine_id: str
    # Shipped events not confirmed within this long stop keeping the engine stepping (a worker
    # that cannot confirm must not make the engine spin); they are acknowledged anyway.
    confirm_within_s: float = 10.0
    clock: Callable[[], float] = time.monotonic
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _entries: deque[_Entry] = field(default_factory=deque)
    _epoch: int = 0
    _acked: int = 0

    def new_log(self) -> None:
        """The router's log changed (another routerId): later sequences name other events."""
        with self._lock:
            self._epoch += 1
            self._acked = 0
            # Events of the old log still hold (a peer gone is gone): they are still shipped
            # and applied, but their sequences are never acknowledged to the new log.
            for e in self._entries:
                e.epoch = -1

    def put(self, event: dict[str, Any]) -> None:
        command = to_command(event, self.engine_id)
        with self._lock:
            self._entries.append(_Entry(seq=int(event["seq"]), epoch=self._epoch, command=command))

    def ship(self) -> list[Command]:
        """Commands to attach to this step's metadata (each shipped once)."""
        now = self.clock()
        out: list[Command] = []
        with self._lock:
            for e in self._entries:
                if e.shipped_at is None:
                    e.shipped_at = now
                    if e.command is None:
                        e.done = True
                    else:
                        out.append(e.command)
        return out

    def confirm(self, seqs: set[int] | frozenset[int]) -> None:
        """Every worker applied `seqs`."""
        with self._lock:
            for e in self._entries:
                if e.seq in seqs and e.shipped_at is not None:
                    e.done = True

    def expire(self) -> list[int]:
        """Shipped events no worker confirmed within confirm_within_s: given up on, returned."""
        now = self.clock()
        late: list[int] = []
        with self._lock:
            for e in self._entries:
                if e.shipped_at is not None and not e.done and now - e.shipped_at > self.confirm_within_s:
                    e.done = True
                    late.append(e.seq)
        return late

    def ack(self) -> int | None:
        """A new cumulative acknowledgement for the router, if there is one."""
        with self._lock:
            return self._advance()

    def busy(self) -> bool:
        """Whether the engine must step: events wait to be shipped or confirmed."""
        now = self.clock()
        with self._lock:
            return any(
                e.shipped_at is None or (not e.done and now - e.shipped_at <= self.confirm_within_s)
                for e in self._entries
            )

    def _advance(self) -> int | None:
        ack = None
        while self._entries and self._entries[0].done:
            e = self._entries.popleft()
            if e.epoch == self._epoch and e.seq > self._acked:
                self._acked = e.seq
                ack = e.seq
        return ack


def to_command(event: dict[str, Any], engine_id: str) -> Command | None:
    """A router event as a worker command; None for one that asks nothing of this engine."""
    kind = event.get("type")
    seq = int(event["seq"])
    reason = str(event.get("reason", ""))[:256]
    if kind == "peer_gone":
        ids = [i for i in event.get("engineIds", []) if i != engine_id]
        return Command(seq, "peer_gone", ids, reason) if ids else None
    if kind == "snapshot":
        ids = [i for i in event.get("goneEngineIds", []) if i != engine_id]
        return Command(seq, "peer_gone", ids, "snapshot") if ids else None
    if kind == "peer_alive":
        return Command(seq, "peer_alive", list(event.get("engineIds", [])), reason)
    if kind == "lease_release":
        if event.get("prefillEngineId") != engine_id:
            return None
        return Command(seq, "lease_release", list(event.get("requestIds", [])), reason)
    return None
