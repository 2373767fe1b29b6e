"""Runs the connector's Follower against real routers, with no vLLM: each event is printed as
a JSON line and acknowledged at once, as the scheduler-side connector does once every worker
applied it. Used by test/connector/follower.test.ts.

    python3 follow_router.py --engine-id ID --role decode --agent-url URL --router URL [...]
"""

import argparse
import json
import os
import sys
import threading

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from handoff_vllm.follower import Follower, Registration  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--engine-id", required=True)
    p.add_argument("--role", default="decode")
    p.add_argument("--agent-url", required=True)
    p.add_argument("--engine-url")
    p.add_argument("--router", action="append", required=True)
    p.add_argument("--keepalive-s", type=float, default=15.0)
    args = p.parse_args()
    lock = threading.Lock()

    def say(obj: dict) -> None:
        with lock:
            print(json.dumps(obj), flush=True)

    follower: Follower

    def on_event(event: dict) -> None:
        say({"event": event})
        follower.ack(int(event["seq"]))

    follower = Follower(
        args.router,
        Registration(f"vllm-{args.engine_id}", args.engine_id, args.role, args.agent_url, args.engine_url),
        on_event=on_event,
        on_new_log=lambda: say({"new_log": True}),
        token=lambda: os.environ.get("HANDOFF_AGENT_TOKEN"),
        keepalive_s=args.keepalive_s,
    )
    follower.start()
    say({"started": True})
    sys.stdin.read()  # until the test closes stdin
    follower.stop()


if __name__ == "__main__":
    main()
