#!/usr/bin/env python3
"""Blocking preStop drain for a handoff engine pod (issue 11; docs/api.md, autoscaler hooks).

The kubelet runs this in the engine container before it sends SIGTERM. It asks the handoff
router to drain this pod's instance (`POST /admin/instances/<id>/drain` with `wait`) and
returns only once the router holds nothing of it: no request in flight and, for a
prefiller, no unread lease (a decoder may still be about to READ this engine's KV blocks
after the prefill leg ended). Until then the engine keeps serving, so those reads succeed.

Python 3 standard library only: it runs inside the vLLM image, which has python3 and no
handoff code.

Inputs (a flag wins over its environment variable):
  --router-url / HANDOFF_ROUTER_URL   comma-separated router URLs; each is tried in turn, so
                                      one router down does not block the drain
  --token-file / HANDOFF_ADMIN_TOKEN_FILE, else HANDOFF_ADMIN_TOKEN   the router's admin token
  --instance-id / HANDOFF_INSTANCE_ID, else k8s:<POD_NAMESPACE>:<POD_NAME>  (the id the
                                      router's Kubernetes discovery gives the pod; downward API)
  --deadline-seconds / HANDOFF_DRAIN_DEADLINE_SECONDS   give up after this long: the pod's
                                      terminationGracePeriodSeconds minus a margin, which the
                                      engine needs to stop after SIGTERM
  --progress-seconds                  one progress line (what is still left) this often
  --retries                           rounds over every URL with no answer before giving up;
                                      0 (the default): until the deadline, so a Redis failover
                                      (503 from every router) or a router rollout is waited out
  --log-file / HANDOFF_DRAIN_LOG_FILE  also append the lines there (best effort), e.g.
                                      /proc/1/fd/2 so they show in `kubectl logs`

Exit status: 0 drained, removed, or unknown to the router (404: nothing routes to this pod,
e.g. it never became Ready, discovery already retired it, or the drain ended between two polls); 1 the deadline passed with work
left; 2 no router could be reached; 3 bad arguments; 4 a router refused the call (401/403:
wrong admin token; 400). Whatever the status, Kubernetes goes on with the termination: a
failed preStop hook is only logged as a FailedPreStopHook event on the pod (with this
script's output), and the kubelet still sends SIGTERM once the hook returns or the grace
period runs out. A non-zero exit therefore means "terminated while the router still held
work here": decoders reading this engine's blocks may fail those requests.
"""

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

EXIT_DRAINED, EXIT_DEADLINE, EXIT_UNREACHABLE, EXIT_USAGE, EXIT_REFUSED = 0, 1, 2, 3, 4
# The router's limit on one wait (admin.ts MAX_WAIT_MS), in ms.
MAX_WAIT_MS = 600_000

_log_file = None


def log(msg):
    line = "handoff-prestop: " + msg
    print(line, file=sys.stderr, flush=True)
    if _log_file:
        try:
            with open(_log_file, "a", encoding="utf-8") as f:
                f.write(line + "\n")
        except OSError:
            pass  # best effort: stderr has it


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        # argparse exits 2, which here means "no router reachable".
        self.print_usage(sys.stderr)
        log("FAILED: %s" % message)
        sys.exit(EXIT_USAGE)


def parse_args(argv):
    env = os.environ
    p = _Parser(description="Drain this pod's instance at the handoff router and wait until it holds nothing.")
    p.add_argument("--router-url", default=env.get("HANDOFF_ROUTER_URL", ""))
    p.add_argument("--token-file", default=env.get("HANDOFF_ADMIN_TOKEN_FILE", ""))
    p.add_argument("--instance-id", default=env.get("HANDOFF_INSTANCE_ID", ""))
    p.add_argument("--deadline-seconds", type=float, default=float(env.get("HANDOFF_DRAIN_DEADLINE_SECONDS", "30")))
    p.add_argument("--progress-seconds", type=float, default=5.0)
    p.add_argument("--retries", type=int, default=0)
    p.add_argument("--log-file", default=env.get("HANDOFF_DRAIN_LOG_FILE", ""))
    a = p.parse_args(argv)
    a.urls = [u.strip().rstrip("/") for u in a.router_url.split(",") if u.strip()]
    if not a.urls:
        p.error("no router URL: --router-url or HANDOFF_ROUTER_URL")
    for u in a.urls:
        if not u.startswith(("http://", "https://")):
            p.error("not an http(s) URL: %r" % u)
    if not a.instance_id:
        ns, pod = env.get("POD_NAMESPACE", ""), env.get("POD_NAME", "")
        if not ns or not pod:
            p.error("no instance id: --instance-id, HANDOFF_INSTANCE_ID, or POD_NAMESPACE and POD_NAME (downward API)")
        a.instance_id = "k8s:%s:%s" % (ns, pod)
    if a.token_file:
        try:
            with open(a.token_file, encoding="utf-8") as f:
                a.token = f.read().strip()
        except OSError as e:
            p.error("cannot read the admin token file: %s" % e)
    else:
        a.token = env.get("HANDOFF_ADMIN_TOKEN", "").strip()
    if not a.token:
        p.error("no admin token: --token-file, HANDOFF_ADMIN_TOKEN_FILE or HANDOFF_ADMIN_TOKEN")
    if a.deadline_seconds <= 0 or a.progress_seconds <= 0 or a.retries < 0:
        p.error("--deadline-seconds and --progress-seconds must be > 0, --retries >= 0")
    return a


class Refused(Exception):
    """The router answered, and asking again will not help (401, 403, 400)."""


def drain_once(url, args, wait_ms, socket_timeout):
    """One drain call with wait. Returns the router's status dict, or None for 404."""
    path = "/admin/instances/%s/drain" % urllib.parse.quote(args.instance_id, safe="")
    body = json.dumps({"wait": True, "timeoutMs": wait_ms}).encode()
    req = urllib.request.Request(
        url + path,
        data=body,
        method="POST",
        headers={"content-type": "application/json", "authorization": "Bearer " + args.token},
    )
    try:
        with urllib.request.urlopen(req, timeout=socket_timeout) as res:
            return json.loads(res.read().decode() or "{}")
    except urllib.error.HTTPError as e:
        text = e.read().decode(errors="replace")[:300]
        if e.code == 404:
            return None
        if e.code in (400, 401, 403):
            raise Refused("%s answered %d: %s" % (url, e.code, text))
        # 5xx (e.g. 503 RTR_ERR_STORE_UNAVAILABLE while the shared store is down): try again.
        raise OSError("HTTP %d: %s" % (e.code, text))


def main(argv):
    global _log_file
    args = parse_args(argv)
    _log_file = args.log_file or None
    start = time.monotonic()
    deadline = start + args.deadline_seconds
    log("draining %s via %s (deadline %g s)" % (args.instance_id, ", ".join(args.urls), args.deadline_seconds))

    last = None  # the last status a router gave
    failed_rounds = 0
    refused = []
    i = 0  # the URL in use: the first that answers, then the next one on a failure
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        # Bound each wait by the progress period, so a line says what is left that often.
        wait_ms = max(1, min(MAX_WAIT_MS, int(min(args.progress_seconds, left) * 1000)))
        url = args.urls[i % len(args.urls)]
        try:
            status = drain_once(url, args, wait_ms, socket_timeout=wait_ms / 1000 + 10)
        except Refused as e:
            refused.append(str(e))
            log("refused: %s" % e)
            if len(refused) >= len(args.urls):
                log("FAILED: every router refused the drain of %s (check the admin token)" % args.instance_id)
                return EXIT_REFUSED
            i += 1
            continue
        except (OSError, ValueError) as e:  # URLError, timeouts, resets, bad JSON
            log("%s: %s" % (url, getattr(e, "reason", e)))
            i += 1
            if i % len(args.urls) == 0:
                failed_rounds += 1
                if args.retries and failed_rounds >= args.retries:
                    log("FAILED: no router reachable after %d rounds over %s" % (failed_rounds, ", ".join(args.urls)))
                    return EXIT_UNREACHABLE
                time.sleep(max(0, min(0.5 * 2 ** (failed_rounds - 1), 3, deadline - time.monotonic())))
            continue
        failed_rounds = 0
        elapsed = time.monotonic() - start
        if status is None:
            if last is None:
                log("%s is not known to %s (404): nothing routes to it, done after %.1f s" % (args.instance_id, url, elapsed))
            else:
                # A router answered for it before: the drain ended (and removed it) between two
                # polls, or it was removed; either way nothing is left to wait for.
                log("%s gone from %s after %.1f s (404: drained and removed between two polls, or removed): nothing routes to it"
                    % (args.instance_id, url, elapsed))
            return EXIT_DRAINED
        last = status
        if status.get("drained"):
            log("%s drained after %.1f s: no request in flight, no unread lease" % (args.instance_id, elapsed))
            return EXIT_DRAINED
        if status.get("removed"):
            # Removed while this call waited (by hand, or by discovery): nothing routes to it.
            log("%s removed after %.1f s: the router no longer routes to it" % (args.instance_id, elapsed))
            return EXIT_DRAINED
        log(
            "waiting for %s: %d in flight, %d unread lease(s)%s, %.1f s elapsed, %.1f s left"
            % (args.instance_id, status.get("inflight", -1), status.get("unreadLeases", -1), unheard(status), elapsed, max(0, deadline - time.monotonic()))
        )

    if last is None:
        log("FAILED: deadline (%g s) passed before any router answered for %s" % (args.deadline_seconds, args.instance_id))
        return EXIT_UNREACHABLE
    log(
        "FAILED: deadline (%g s) passed with %s not drained: %d in flight, %d unread lease(s)%s; "
        "the kubelet now stops the engine, and decoders still reading its blocks may fail"
        % (args.deadline_seconds, args.instance_id, last.get("inflight", -1), last.get("unreadLeases", -1), unheard(last))
    )
    return EXIT_DEADLINE


def unheard(status):
    """The routers (sharing Redis) that have not yet said what they have in flight there."""
    n = status.get("unheardRouters", 0)
    return ", %d router(s) not yet heard from" % n if n else ""


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
