"""The router's agent event stream, followed from inside a vLLM engine (stdlib only).

The same protocol as the transfer agent's router link (docs/api.md "Agent plane"):

- ``POST /v1/agents`` registers before every stream: the engine_id, role, side-channel address
  (``agentUrl``: its host:port is the address D workers handshake with) and the engine's URL;
  the answer names the log (``routerId``, ``lastSeq``);
- ``GET /v1/agents/<id>/events?after=N`` is an SSE stream of every event after N;
- ``POST /v1/agents/<id>/acks {"seq": N}``: everything up to N was applied by every worker.

A stream silent for three keep-alive intervals is taken as dead. Any failure moves to the next
router URL after a jittered backoff; a router that forgot this engine or ended the stream is
tried again first. A registration answer from another log (a new ``routerId``, or a
``lastSeq`` below what was received) starts over from 0, because that log's sequence numbers
name other events.
"""

from __future__ import annotations

import http.client
import json
import logging
import random
import threading
from dataclasses import dataclass
from typing import Any, Callable
from urllib.parse import quote, urlsplit

log = logging.getLogger("vllm.handoff")


@dataclass(frozen=True)
class Registration:
    agent_id: str
    engine_id: str
    role: str  # prefill | decode | both
    agent_url: str
    engine_url: str | None

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "agentId": self.agent_id,
            "engineId": self.engine_id,
            "role": self.role,
            "agentUrl": self.agent_url,
            "kind": "vllm-connector",
        }
        if self.engine_url:
            body["engineUrl"] = self.engine_url
        return body


class RouterAnswer(Exception):
    def __init__(self, status: int, code: str | None, text: str):
        super().__init__(f"router answered {status}{' ' + code if code else ''}: {text[:200]}")
        self.status = status
        self.code = code


class Follower:
    """Runs on its own daemon thread; `on_event` is called there, in sequence order."""

    def __init__(
        self,
        urls: list[str],
        registration: Registration,
        on_event: Callable[[dict[str, Any]], None],
        on_new_log: Callable[[], None],
        token: Callable[[], str | None] = lambda: None,
        keepalive_s: float = 15.0,
        call_timeout_s: float = 5.0,
        backoff_s: tuple[float, float] = (0.1, 2.0),
    ):
        if not urls:
            raise ValueError("handoff: no router URL")
        for u in urls:
            if urlsplit(u).scheme not in ("http", "https") or not urlsplit(u).netloc:
                raise ValueError(f"handoff: not a router URL: {u!r}")
        self.urls = [u.rstrip("/") for u in urls]
        self.registration = registration
        self.on_event = on_event
        self.on_new_log = on_new_log
        self.token = token
        # Until a router says its keep-alive interval (its registration answer).
        self.keepalive_s = keepalive_s
        self.idle_s = 3 * keepalive_s
        self.call_timeout_s = call_timeout_s
        self.backoff_s = backoff_s
        self.connected = False
        self.router_id: str | None = None
        self.received = 0
        self.acked = 0
        self._index = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._stream: http.client.HTTPConnection | None = None
        self._ack_wanted = 0
        self._ack_signal = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, name="handoff-router-events", daemon=True),
            threading.Thread(target=self._run_acks, name="handoff-router-acks", daemon=True),
        ]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        self._ack_signal.set()
        with self._lock:
            stream = self._stream
        if stream is not None:
            try:
                # Unblocks the reader's readline.
                if stream.sock is not None:
                    stream.sock.shutdown(2)
            except OSError:
                pass
        for t in self._threads:
            if t.is_alive() and t is not threading.current_thread():
                t.join(timeout=2)

    def ack(self, seq: int) -> None:
        """Every worker applied everything up to `seq` (sent from the ack thread)."""
        with self._lock:
            self._ack_wanted = max(self._ack_wanted, seq)
        self._ack_signal.set()

    # --- the stream -------------------------------------------------------------------------

    def _run(self) -> None:
        low, high = self.backoff_s
        backoff = low
        outage = False
        while not self._stop.is_set():
            url = self.urls[self._index]
            ended = False
            failure: Exception | None = None
            try:
                self._register(url)
                after = self.received

                def opened() -> None:
                    nonlocal backoff, outage
                    backoff = low
                    log.info(
                        "handoff: router event stream %s at %s (log %s, after %d)",
                        "back" if outage else "open", url, self.router_id, after,
                    )
                    outage = False

                self._follow(url, opened)
                ended = True
            except Exception as err:  # noqa: BLE001 - every failure means: reconnect
                failure = err
            self.connected = False
            if self._stop.is_set():
                break
            forgot = isinstance(failure, RouterAnswer) and failure.code == "RTR_ERR_AGENT_UNKNOWN"
            if not ended and not forgot:
                self._index = (self._index + 1) % len(self.urls)
            if not outage:
                log.warning(
                    "handoff: router event stream lost at %s (%s); retrying, next %s",
                    url, "the router ended it" if ended else describe(failure), self.urls[self._index],
                )
                outage = True
            wait = backoff / 2 + random.random() * backoff / 2
            backoff = min(high, backoff * 2)
            self._stop.wait(wait)

    def _register(self, url: str) -> None:
        answer = self._call(url, "/v1/agents", self.registration.body())
        router_id = answer.get("routerId") if isinstance(answer, dict) else None
        last_seq = answer.get("lastSeq", 0) if isinstance(answer, dict) else 0
        other = (self.router_id is not None and router_id is not None and router_id != self.router_id) or (
            isinstance(last_seq, int) and last_seq < self.received
        )
        if other:
            log.warning(
                "handoff: another event log at %s (was %s, now %s; received %d, its last %s): "
                "following it from its start",
                url, self.router_id, router_id, self.received, last_seq,
            )
            self.received = 0
            with self._lock:
                self.acked = 0
                self._ack_wanted = 0
            self.on_new_log()
        if isinstance(router_id, str):
            self.router_id = router_id
        # Silence for three of the router's keep-alive intervals (at least 3 s): it stalled,
        # follow the next one. A router that does not say keeps the configured figure.
        keepalive_ms = answer.get("keepAliveMs") if isinstance(answer, dict) else None
        self.idle_s = max(3.0, 3 * keepalive_ms / 1000) if isinstance(keepalive_ms, int) and keepalive_ms > 0 else 3 * self.keepalive_s

    def _follow(self, url: str, opened: Callable[[], None]) -> None:
        conn = connection(url, self.idle_s)
        with self._lock:
            self._stream = conn
        try:
            path = f"{urlsplit(url).path}/v1/agents/{quote(self.registration.agent_id, safe='')}/events?after={self.received}"
            conn.request("GET", path, headers={"accept": "text/event-stream", **self._auth()})
            res = conn.getresponse()
            if res.status != 200:
                raise answer_error(res.status, res.read().decode("utf-8", "replace"))
            self.connected = True
            opened()
            self._ack_signal.set()  # acks that failed while disconnected go now
            lines: list[str] = []
            while not self._stop.is_set():
                raw = res.readline()
                if not raw:
                    return  # the router ended the stream
                line = raw.decode("utf-8").rstrip("\r\n")
                if line:
                    lines.append(line)
                    continue
                event = parse_frame(lines)
                lines = []
                if event is None:
                    continue
                if event.get("type") != "snapshot" and event["seq"] <= self.received:
                    continue  # a repeat after a resume overlap
                self.on_event(event)
                self.received = max(self.received, int(event["seq"]))
        finally:
            with self._lock:
                self._stream = None
            conn.close()

    # --- acks -------------------------------------------------------------------------------

    def _run_acks(self) -> None:
        while not self._stop.is_set():
            self._ack_signal.wait()
            self._ack_signal.clear()
            while not self._stop.is_set() and self.connected:
                with self._lock:
                    seq = self._ack_wanted
                    if seq <= self.acked:
                        break
                router_id = self.router_id
                url = self.urls[self._index]
                try:
                    self._call(url, f"/v1/agents/{quote(self.registration.agent_id, safe='')}/acks", {"seq": seq})
                except Exception as err:  # noqa: BLE001 - sent again with the next event or stream
                    log.debug("handoff: ack %d failed: %s", seq, describe(err))
                    break
                with self._lock:
                    if router_id == self.router_id:
                        self.acked = max(self.acked, seq)

    # --- HTTP -------------------------------------------------------------------------------

    def _call(self, url: str, path: str, body: Any) -> Any:
        conn = connection(url, self.call_timeout_s)
        try:
            conn.request(
                "POST",
                f"{urlsplit(url).path}{path}",
                body=json.dumps(body),
                headers={"content-type": "application/json", **self._auth()},
            )
            res = conn.getresponse()
            text = res.read().decode("utf-8", "replace")
            if res.status >= 300:
                raise answer_error(res.status, text)
            return json.loads(text) if text else None
        finally:
            conn.close()

    def _auth(self) -> dict[str, str]:
        token = self.token()
        return {"authorization": f"Bearer {token}"} if token else {}


def connection(url: str, timeout: float) -> http.client.HTTPConnection:
    parts = urlsplit(url)
    cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    return cls(parts.hostname or "localhost", parts.port, timeout=timeout)


def parse_frame(lines: list[str]) -> dict[str, Any] | None:
    """One SSE frame's JSON `data:`; None for a comment, a keep-alive or a bad frame."""
    data = [line[6:] if line.startswith("data: ") else line[5:] for line in lines if line.startswith("data:")]
    if not data:
        return None
    try:
        event = json.loads("\n".join(data))
    except ValueError:
        return None
    if not isinstance(event, dict) or not isinstance(event.get("seq"), int) or not isinstance(event.get("type"), str):
        return None
    return event


def answer_error(status: int, text: str) -> RouterAnswer:
    code = None
    try:
        code = json.loads(text).get("error", {}).get("code")
    except (ValueError, AttributeError):
        pass
    return RouterAnswer(status, code, text)


def describe(err: BaseException | None) -> str:
    return f"{type(err).__name__}: {err}" if err is not None else "unknown"

