"""A multi-host bed on one machine: network namespaces joined by shaped veth links.

    from splitserve.testbed.netbed import NetBed, LinkSpec

    with NetBed(hosts=("a", "b"), link=LinkSpec.parse("1gbit")) as bed:
        a, b = bed.hosts["a"], bed.hosts["b"]
        server = bed.popen("a", [sys.executable, "-m", "http.server", "8000", "--bind", a.address])
        bed.run("b", ["curl", f"http://{a.address}:8000/"])
        bed.set_link("a", LinkSpec.parse("100mbit"))   # reshape live
        bed.link_down("b")                             # `ip link set down`: b is cut off
        with bed.bulk_flow("a", "b"):                  # a backup sharing a's and b's links
            ...
    # everything is gone here, also after an exception: processes, namespaces, veths, bridge

Picture (one /24 of 10.200-250.x.0 chosen per run, free of the addresses in use here):

    root namespace: bridge ssb<run> 10.R.S.1 ── veth ssv<run><i> ══ tc ══ ssp<run><i> 10.R.S.(2+i)  netns ss-<run>-<host>

Each host's link is shaped on both of its ends (the root side shapes what the host receives,
the namespace side what it sends) with `tbf` at the link's rate, under a `netem` delay when one
is asked for. The root namespace reaches every host through the bridge address, so a frontend
there can serve engines in the hosts. Names carry a random run id, so parallel beds never
collide; `cleanup_stale()` (CLI: `python -m splitserve.testbed cleanup`) removes beds whose
owning process died without tearing down (SIGKILL).

Needs root, `ip` and `tc`; `unavailable_reason()` says why a bed cannot be built here (tests
skip with that reason). This machine's kernel has `tbf` but no `netem`, so a delay raises
`NetbedUnavailable` naming the missing qdisc instead of being silently dropped.
"""
from __future__ import annotations

import atexit
import ipaddress
import json
import os
import re
import secrets
import subprocess
from dataclasses import dataclass

from splitserve.testbed.bulk import BulkFlow
from splitserve.testbed.netns import (STATE_DIR, NetbedUnavailable, cleanup_stale, enter_netns, free_subnet, ip,
                                      kill_namespace_pids, qdisc_available, sh, stop_session, unavailable_reason)

__all__ = ["Host", "LinkSpec", "NetBed", "NetbedUnavailable", "cleanup_stale", "qdisc_available",
           "unavailable_reason"]

_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(k|m|g)?bit\s*$", re.IGNORECASE)
_UNIT = {None: 1, "k": 1e3, "m": 1e6, "g": 1e9}


@dataclass(frozen=True, slots=True)
class LinkSpec:
    """One host's link: a rate in bit/s and an added one-way delay, each in both directions
    (a path between two hosts crosses two links: their delays add, the slower rate rules)."""
    rate_bps: int = 1_000_000_000
    delay_ms: float = 0.0

    def __post_init__(self):
        if not 1_000_000 <= self.rate_bps <= 100_000_000_000:
            raise ValueError(f"link rate {self.rate_bps} bit/s: give 1mbit .. 100gbit")
        if not 0 <= self.delay_ms <= 10_000:
            raise ValueError(f"link delay {self.delay_ms} ms: give 0 .. 10000")

    @classmethod
    def parse(cls, rate: str, delay_ms: float = 0.0) -> "LinkSpec":
        """`100mbit`, `1gbit`, `10gbit` (tc's spelling)."""
        m = _RATE.match(rate)
        if not m:
            raise ValueError(f"link rate {rate!r}: write it as tc does, e.g. 100mbit, 1gbit, 10gbit")
        return cls(int(float(m.group(1)) * _UNIT[m.group(2) and m.group(2).lower()]), delay_ms)

    @property
    def label(self) -> str:
        for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
            if self.rate_bps >= scale and self.rate_bps % scale == 0:
                text = f"{self.rate_bps // int(scale)}{unit}"
                break
        else:
            text = f"{self.rate_bps}bit"
        return text + (f"+{self.delay_ms:g}ms" if self.delay_ms else "")


@dataclass(frozen=True, slots=True)
class Host:
    name: str          # the bed's name for it ("a", "b", ...)
    netns: str         # the namespace: `ip netns exec <netns> ...`
    address: str       # its address on the bed's subnet
    veth_root: str     # its link's end in the root namespace (on the bridge)
    veth_host: str     # its link's end inside the namespace

    def argv(self, argv: list[str]) -> list[str]:
        """A command line that runs `argv` inside this host."""
        return ["ip", "netns", "exec", self.netns, *argv]

    def enter(self) -> None:
        """Move the calling thread (only it, and the threads it starts later) into this host's
        network namespace: sockets it opens from now on live there. For fast tests that run
        several "hosts" as threads of one process; a thread cannot go back."""
        enter_netns(self.netns)


class NetBed:
    """2-3 (or more) hosts as network namespaces on one bridge; see the module docstring.

    `hosts`: the hosts' names; `link`: every host's link; `links`: per-host overrides.
    Build it with `with NetBed(...) as bed:`; `close()` is idempotent and also runs at exit."""

    def __init__(self, hosts: tuple[str, ...] | list[str] = ("a", "b"), link: LinkSpec = LinkSpec(),
                 links: dict[str, LinkSpec] | None = None):
        if not 1 <= len(hosts) <= 16 or len(set(hosts)) != len(hosts):
            raise ValueError(f"hosts {hosts!r}: give 1..16 distinct names")
        for name in hosts:
            if not re.fullmatch(r"[a-z0-9]{1,8}", name):
                raise ValueError(f"host name {name!r}: use 1-8 lowercase letters or digits")
        unknown = set(links or {}) - set(hosts)
        if unknown:
            raise ValueError(f"links name hosts {sorted(unknown)} that are not in hosts {list(hosts)}")
        self.run_id = secrets.token_hex(3)
        self.bridge = f"ssb{self.run_id}"
        self.subnet: ipaddress.IPv4Network | None = None
        self.gateway = ""            # the bridge's address: the root namespace as seen from a host
        self.hosts: dict[str, Host] = {}
        self.links: dict[str, LinkSpec] = {h: (links or {}).get(h, link) for h in hosts}
        self._names = tuple(hosts)
        self._procs: list[subprocess.Popen] = []
        self._flows: list[BulkFlow] = []
        self._state_file = STATE_DIR / f"{self.run_id}.json"
        self._open = False

    # -- lifecycle -------------------------------------------------------------------------
    def __enter__(self) -> "NetBed":
        self.open()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def open(self) -> "NetBed":
        reason = unavailable_reason()
        if reason:
            raise NetbedUnavailable(reason)
        for h, spec in self.links.items():
            if spec.delay_ms and not qdisc_available("netem"):
                raise NetbedUnavailable(f"host {h}: a {spec.delay_ms:g} ms delay needs the netem qdisc, "
                                        "which this kernel lacks (sch_netem); use delay_ms=0 here")
        self._open = True
        atexit.register(self.close)
        try:
            self._write_state()
            self.subnet = free_subnet()
            hosts = list(self.subnet.hosts())
            self.gateway = str(hosts[0])
            ip("link", "add", self.bridge, "type", "bridge")
            ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            ip("link", "set", self.bridge, "up")
            for i, name in enumerate(self._names):
                host = Host(name, f"ss-{self.run_id}-{name}", str(hosts[1 + i]),
                            f"ssv{self.run_id}{i:x}", f"ssp{self.run_id}{i:x}")
                self.hosts[name] = host
                self._write_state()
                ip("netns", "add", host.netns)
                ip("link", "add", host.veth_root, "type", "veth", "peer", "name", host.veth_host)
                ip("link", "set", host.veth_host, "netns", host.netns)
                ip("link", "set", host.veth_root, "master", self.bridge, "up")
                inside = ["-n", host.netns]
                ip(*inside, "addr", "add", f"{host.address}/24", "dev", host.veth_host)
                ip(*inside, "link", "set", host.veth_host, "up")
                ip(*inside, "link", "set", "lo", "up")
                self._shape(host, self.links[name])
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Stop every process started here, then remove the hosts and the bridge."""
        if not self._open:
            return
        self._open = False
        atexit.unregister(self.close)
        for flow in self._flows:
            flow.stop()
        for proc in self._procs:
            stop_session(proc)
        for host in self.hosts.values():
            kill_namespace_pids(host.netns)
            ip("link", "del", host.veth_root, check=False)
            ip("netns", "del", host.netns, check=False)
        ip("link", "del", self.bridge, check=False)
        self._state_file.unlink(missing_ok=True)

    def _write_state(self) -> None:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        self._state_file.write_text(json.dumps({
            "pid": os.getpid(), "bridge": self.bridge,
            "hosts": {n: [h.netns, h.veth_root] for n, h in self.hosts.items()}}))

    # -- links -----------------------------------------------------------------------------
    def _shape(self, host: Host, spec: LinkSpec) -> None:
        for inside, dev in (([], host.veth_root), (["ip", "netns", "exec", host.netns], host.veth_host)):
            sh([*inside, "tc", "qdisc", "del", "dev", dev, "root"], check=False)
            rate_bytes = spec.rate_bps / 8
            # burst: at least one 64 KiB GSO segment, and about 1 ms of traffic at high rates
            burst = max(64 * 1024, int(rate_bytes / 1000))
            tbf = ["tbf", "rate", f"{spec.rate_bps}bit", "burst", str(burst), "latency", "100ms"]
            if spec.delay_ms:
                sh([*inside, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem",
                     "delay", f"{spec.delay_ms}ms"])
                sh([*inside, "tc", "qdisc", "add", "dev", dev, "parent", "1:", "handle", "10:", *tbf])
            else:
                sh([*inside, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", *tbf])

    def set_link(self, name: str, spec: LinkSpec) -> None:
        """Reshape a host's link while processes run."""
        if spec.delay_ms and not qdisc_available("netem"):
            raise NetbedUnavailable("a delay needs the netem qdisc, which this kernel lacks")
        self._shape(self.host(name), spec)
        self.links[name] = spec

    def link_down(self, name: str) -> None:
        """`ip link set down` on the host's end in the root namespace: the host is cut off."""
        ip("link", "set", self.host(name).veth_root, "down")

    def link_up(self, name: str) -> None:
        ip("link", "set", self.host(name).veth_root, "up")

    # -- processes -------------------------------------------------------------------------
    def host(self, name: str) -> Host:
        if name not in self.hosts:
            raise KeyError(f"no host {name!r} in this bed; hosts: {sorted(self.hosts)}")
        return self.hosts[name]

    def popen(self, name: str, argv: list[str], **kwargs) -> subprocess.Popen:
        """Start `argv` inside a host (its own session, so teardown stops its children too)."""
        proc = subprocess.Popen(self.host(name).argv(argv), start_new_session=True, **kwargs)
        self._procs.append(proc)
        return proc

    def run(self, name: str, argv: list[str], timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run(self.host(name).argv(argv), timeout=timeout, **kwargs)

    def bulk_flow(self, src: str, dst: str, port: int = 5201) -> BulkFlow:
        """A bulk TCP flow (the "backup") from `src` to `dst`, started now; `with` stops it.
        It saturates whatever it shares: src's link out and dst's link in."""
        flow = BulkFlow(self.host(src).argv, self.host(dst).argv, self.host(dst).address, port)
        self._flows.append(flow)
        return flow.start()

    def describe(self) -> dict:
        return {"run_id": self.run_id, "bridge": self.bridge, "gateway": self.gateway,
                "hosts": {n: {"netns": h.netns, "address": h.address, "link": self.links[n].label}
                          for n, h in self.hosts.items()}}
