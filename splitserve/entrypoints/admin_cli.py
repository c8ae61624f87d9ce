"""`splitserve admin`: operate a running server through its admin API.

    splitserve admin restart --all [--url http://127.0.0.1:8000]   every instance, one at a time
    splitserve admin restart prefill-0 decode-0                      the ones named, in that order
    splitserve admin restart-coordinator [--url ...]                 serve itself, engines kept

Each restart (POST /admin/instances/{id}/restart) starts a replacement with the same role and
settings, waits until it serves, drains the old instance and waits for its exit before the next
one begins (coordinator/rolling_restart.py). `restart-coordinator` asks serve to re-execute itself
(POST /admin/coordinator/restart: the requests in flight end with an error, the engines keep
running and rejoin; entrypoints/coordinator_restart.py) and waits until it serves again with the
same engine processes. The admin key, when the server has one, is read from
--admin-key-file (kept out of `ps`).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import httpx


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    restart = sub.add_parser("restart", help="replace engine instances one at a time, failing no request")
    restart.add_argument("ids", nargs="*", help="instance ids, in order (see GET /admin/instances)")
    restart.add_argument("--all", action="store_true", help="every instance that serves now")
    restart.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default: %(default)s)")
    restart.add_argument("--admin-key-file", type=Path, default=None, help="file holding the admin key")
    restart.add_argument("--drain-deadline", type=float, default=60.0,
                         help="seconds an instance may take to finish its requests; then they resume elsewhere")
    restart.add_argument("--timeout", type=float, default=900.0, help="seconds one restart may take in all")
    coordinator = sub.add_parser("restart-coordinator",
                                 help="restart serve itself in place; its engines keep running and rejoin")
    coordinator.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default: %(default)s)")
    coordinator.add_argument("--admin-key-file", type=Path, default=None, help="file holding the admin key")
    coordinator.add_argument("--timeout", type=float, default=300.0,
                             help="seconds to wait until it serves again")


def headers(args: argparse.Namespace) -> dict[str, str]:
    if args.admin_key_file is None:
        return {}
    return {"Authorization": f"Bearer {args.admin_key_file.read_text().strip()}"}


def restart(args: argparse.Namespace) -> int:
    if args.all == bool(args.ids):
        print("splitserve admin restart: give instance ids or --all (not both)", file=sys.stderr)
        return 2
    url = args.url.rstrip("/")
    with httpx.Client(headers=headers(args), timeout=args.timeout) as http:
        ids = args.ids
        if args.all:
            listing = http.get(f"{url}/admin/instances")
            listing.raise_for_status()
            ids = [i["id"] for i in listing.json()["instances"] if i["alive"] and not i["draining"]]
        for engine_id in ids:
            r = http.post(f"{url}/admin/instances/{engine_id}/restart", json={"drain_deadline_s": args.drain_deadline})
            if r.status_code != 200:
                print(f"splitserve admin restart: {engine_id}: {r.status_code} {r.json()['error']['message']}",
                      file=sys.stderr)
                return 1
            done = r.json()
            print(f"{engine_id} -> {done['replacement']} ({done['role']}): ready after {done['ready_s']:.1f} s, "
                  f"replaced after {done['seconds']:.1f} s, {done['resumed_requests']} requests resumed elsewhere",
                  flush=True)
    return 0


RESTARTS_METRIC = "splitserve_coordinator_restarts_total"


def restarts_of(metrics_text: str) -> int:
    for line in metrics_text.splitlines():
        if line.startswith(RESTARTS_METRIC + " "):
            return int(float(line.split()[1]))
    return 0


def serving_again(http: httpx.Client, url: str, pids: dict[str, int], restart: int) -> bool:
    """The new process answers (it counts `restart` restarts: not the old one, still stopping) and
    every kept engine is alive in /health, with the same pid."""
    try:
        if restarts_of(http.get(f"{url}/metrics", timeout=5).text) < restart:
            return False
        r = http.get(f"{url}/health", timeout=5)
    except httpx.HTTPError:
        return False  # the new process is not listening yet (its socket queues us) or is starting
    if r.status_code != 200:
        return False
    alive = {i["id"]: i["pid"] for i in r.json()["instances"] if i["alive"]}
    return all(alive.get(engine_id) == pid for engine_id, pid in pids.items())


def restart_coordinator(args: argparse.Namespace) -> int:
    url = args.url.rstrip("/")
    with httpx.Client(headers=headers(args), timeout=30) as http:
        began = time.monotonic()
        r = http.post(f"{url}/admin/coordinator/restart")
        if r.status_code != 202:
            print(f"splitserve admin restart-coordinator: {r.status_code} {r.json()['error']['message']}",
                  file=sys.stderr)
            return 1
        done = r.json()
        pids = {e["id"]: e["pid"] for e in done["engines"]}
        print(f"restarting the coordinator: {done['failed_requests']} requests in flight ended; keeping "
              f"{', '.join(f'{i} (pid {p})' for i, p in pids.items()) or 'no engine'}", flush=True)
        while not serving_again(http, url, pids, done["restart"]):
            if time.monotonic() - began > args.timeout:
                print(f"splitserve admin restart-coordinator: not serving again with the same engines after "
                      f"{args.timeout:.0f} s", file=sys.stderr)
                return 1
            time.sleep(0.2)
        print(f"serving again after {time.monotonic() - began:.1f} s with the same engine processes", flush=True)
    return 0


def run(args: argparse.Namespace) -> int:
    try:
        if args.action == "restart-coordinator":
            return restart_coordinator(args)
        return restart(args)
    except httpx.HTTPError as e:
        print(f"splitserve admin: {args.url}: {e}", file=sys.stderr)
        return 1
