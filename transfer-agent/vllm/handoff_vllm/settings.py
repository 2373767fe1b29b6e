"""The connector's settings: `kv_connector_extra_config` first, then the environment.

    --kv-transfer-config '{"kv_connector":"HandoffNixlConnector",
      "kv_connector_module_path":"handoff_vllm.connector",
      "kv_role":"kv_producer",
      "kv_connector_extra_config":{
        "handoff_router_urls":["http://router-a:8000","http://router-b:8000"],
        "handoff_token_file":"/var/run/handoff/agent-token",
        "handoff_engine_url":"http://10.0.0.7:8000"}}'

Every stock NixlConnector key (kv_lease_duration, engine_ttl, ...) keeps its meaning.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable


class SettingsError(ValueError):
    pass


@dataclass(frozen=True)
class Settings:
    router_urls: list[str]
    token: Callable[[], str | None]
    engine_url: str | None
    keepalive_s: float


def load(extra: dict[str, Any], side_channel_host: str, env: dict[str, str] | None = None, argv: list[str] | None = None) -> Settings:
    env = dict(os.environ) if env is None else env
    urls = extra.get("handoff_router_urls", env.get("HANDOFF_ROUTER_URLS", ""))
    if isinstance(urls, str):
        urls = [u.strip() for u in urls.split(",") if u.strip()]
    if not isinstance(urls, list) or not all(isinstance(u, str) for u in urls):
        raise SettingsError("handoff_router_urls must be a list of router URLs")
    token_file = extra.get("handoff_token_file", env.get("HANDOFF_AGENT_TOKEN_FILE"))
    token_value = env.get("HANDOFF_AGENT_TOKEN")
    if token_file is not None:
        path = Path(str(token_file))
        if not path.is_file():
            raise SettingsError(f"handoff_token_file {path} is not a readable file")

        def token() -> str | None:
            # Read on every registration and call: a rotated Secret takes effect without a restart.
            return path.read_text().strip() or None
    else:

        def token() -> str | None:
            return token_value or None

    engine_url = extra.get("handoff_engine_url", env.get("HANDOFF_ENGINE_URL")) or engine_url_from_argv(
        sys.argv if argv is None else argv, side_channel_host
    )
    keepalive_s = float(extra.get("handoff_keepalive_s", 15.0))
    return Settings(router_urls=urls, token=token, engine_url=engine_url, keepalive_s=keepalive_s)


def engine_url_from_argv(argv: list[str], host: str) -> str | None:
    """The OpenAI server's URL as `vllm serve`/api_server was started (--host, --port).

    The engine core is a child of the API server and keeps its argv. The side-channel host
    stands in for a wildcard --host (the address peers already reach this engine at).
    """
    port = "8000"
    bind: str | None = None
    for i, arg in enumerate(argv):
        for name in ("--port", "--host"):
            value = None
            if arg == name and i + 1 < len(argv):
                value = argv[i + 1]
            elif arg.startswith(name + "="):
                value = arg.split("=", 1)[1]
            if value is None:
                continue
            if name == "--port":
                port = value
            else:
                bind = value
    if not port.isdigit():
        return None
    if bind in (None, "", "0.0.0.0", "::"):
        bind = host
    if ":" in bind and not bind.startswith("["):
        bind = f"[{bind}]"
    return f"http://{bind}:{port}"
