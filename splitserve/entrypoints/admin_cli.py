"""`splitserve admin`: operate a running server through its admin API.

    splitserve admin restart --all [--url http://127.0.0.1:8000]   every instance, one at a time
    splitserve admin restart prefill-0 decode-0                      the ones named, in that order

Each restart (POST /admin/instances/{id}/restart) starts a replacement with the same role and
settings, waits until it serves, drains the old instance and waits for its exit before the next
one begins (coordinator/rolling_restart.py). The admin key, when the server has one, is read from
--admin-key-file (kept out of `ps`).
"""
from __future__ import annotations

import argparse
import sys
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


def run(args: argparse.Namespace) -> int:
    try:
        return restart(args)
    except httpx.HTTPError as e:
        print(f"splitserve admin: {args.url}: {e}", file=sys.stderr)
        return 1
