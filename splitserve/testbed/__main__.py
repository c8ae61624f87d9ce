"""`python -m splitserve.testbed` — build a bed from the shell.

    python -m splitserve.testbed check                       # can a bed be built here? (exit 0/1)
    python -m splitserve.testbed run --hosts a,b --rate 1gbit [--link b=100mbit] [--bulk a:b] -- CMD...
        # builds the bed, runs CMD in the root namespace with NETBED_JSON (the bed's description)
        # and NETBED_<HOST>_NS / NETBED_<HOST>_ADDR in its environment, then tears everything down
    python -m splitserve.testbed up --hosts a,b,c --rate 10gbit  # prints the bed as JSON, holds it
                                                             # until Ctrl-C / SIGTERM, then tears down
    python -m splitserve.testbed cleanup                     # removes beds whose owner died
Inside a host: `ip netns exec $NETBED_A_NS CMD`.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys

from splitserve.testbed.netbed import LinkSpec, NetBed, NetbedUnavailable, cleanup_stale, unavailable_reason


def _bed_from(args) -> NetBed:
    hosts = tuple(h for h in args.hosts.split(",") if h)
    link = LinkSpec.parse(args.rate, args.delay_ms)
    links = {}
    for item in args.link:
        name, _, rate = item.partition("=")
        if not rate:
            raise SystemExit(f"--link {item!r}: write HOST=RATE, e.g. b=100mbit")
        links[name] = LinkSpec.parse(rate, args.delay_ms)
    return NetBed(hosts, link, links)


def _env_of(bed: NetBed) -> dict[str, str]:
    env = dict(os.environ, NETBED_JSON=json.dumps(bed.describe()), NETBED_GATEWAY=bed.gateway)
    for name, host in bed.hosts.items():
        env[f"NETBED_{name.upper()}_NS"] = host.netns
        env[f"NETBED_{name.upper()}_ADDR"] = host.address
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m splitserve.testbed", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("check")
    sub.add_parser("cleanup")
    for name in ("run", "up"):
        p = sub.add_parser(name)
        p.add_argument("--hosts", default="a,b", help="host names, comma-separated (default a,b)")
        p.add_argument("--rate", default="1gbit", help="every link's rate, tc spelling (default 1gbit)")
        p.add_argument("--link", action="append", default=[], metavar="HOST=RATE", help="one host's rate")
        p.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay per link (needs netem)")
        p.add_argument("--bulk", action="append", default=[], metavar="SRC:DST", help="a bulk TCP flow")
        if name == "run":
            p.add_argument("cmd", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)

    if args.command == "check":
        reason = unavailable_reason()
        print(reason or "ok: network namespaces can be built here")
        return 1 if reason else 0
    if args.command == "cleanup":
        print(json.dumps({"removed": cleanup_stale()}))
        return 0
    # SIGTERM becomes an exception so the `with` below tears the bed down
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        with _bed_from(args) as bed:
            for n, item in enumerate(args.bulk):
                src, _, dst = item.partition(":")
                bed.bulk_flow(src, dst, port=5201 + n)
            if args.command == "up":
                print(json.dumps(bed.describe()), flush=True)
                try:
                    signal.pause()
                except KeyboardInterrupt:
                    pass
                return 0
            cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
            if not cmd:
                raise SystemExit("run: give the command after --")
            return subprocess.call(cmd, env=_env_of(bed))
    except NetbedUnavailable as e:
        print(f"cannot build the bed: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
