"""The system calls behind the bed: `ip`/`tc`, whether namespaces and qdiscs exist here, moving a
thread into a namespace, and removing what a bed (or a dead owner's bed) left behind."""
from __future__ import annotations

import ctypes
import functools
import ipaddress
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CLONE_NEWNET = 0x40000000
STATE_DIR = Path(tempfile.gettempdir()) / "splitserve-netbed"


class NetbedUnavailable(RuntimeError):
    """A bed cannot be built on this machine; the message says why and what would fix it."""


def enter_netns(netns: str) -> None:
    """Move the calling thread into a network namespace (`ip netns add` made it)."""
    fd = os.open(f"/var/run/netns/{netns}", os.O_RDONLY)
    try:
        if _libc().setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {netns}: {os.strerror(err)}")
    finally:
        os.close(fd)


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def sh(argv: list[str], check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, capture_output=True, text=True)
    if check and done.returncode:
        raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr.strip() or done.stdout.strip()}")
    return done


@functools.cache
def unavailable_reason() -> str | None:
    """None when a bed can be built here, else why not (a skip reason)."""
    reason = None
    if sys.platform != "linux":
        reason = "network namespaces need Linux"
    elif os.geteuid() != 0:
        reason = "network namespaces need root (run as root, or in a container with CAP_NET_ADMIN)"
    elif not (shutil.which("ip") and shutil.which("tc")):
        reason = "`ip` and `tc` (iproute2) are not installed"
    else:
        probe = f"ss-probe-{secrets.token_hex(3)}"
        done = ip("netns", "add", probe, check=False)
        if done.returncode:
            reason = f"`ip netns add` failed: {done.stderr.strip()}"
        else:
            ip("netns", "del", probe, check=False)
    return reason


@functools.cache
def qdisc_available(kind: str) -> bool:
    """Whether the kernel has a queueing discipline (netem is missing from some kernels)."""
    dev = f"ssq{secrets.token_hex(3)}"
    ip("link", "add", dev, "type", "dummy", check=False)
    args = {"netem": ["delay", "1ms"], "tbf": ["rate", "1mbit", "burst", "32kb", "latency", "50ms"]}
    done = sh(["tc", "qdisc", "add", "dev", dev, "root", kind, *args.get(kind, [])], check=False)
    ip("link", "del", dev, check=False)
    return done.returncode == 0


def free_subnet() -> ipaddress.IPv4Network:
    used = ip("-4", "-o", "addr", "show").stdout + ip("-4", "route", "show", "table", "all").stdout
    for _ in range(200):
        net = ipaddress.IPv4Network(f"10.{200 + secrets.randbelow(51)}.{secrets.randbelow(256)}.0/24")
        if f"10.{net.network_address.packed[1]}.{net.network_address.packed[2]}." not in used:
            return net
    raise NetbedUnavailable("no free 10.200-250.x.0/24 subnet for the bed; remove stale beds "
                            "(python -m splitserve.testbed cleanup)")


def stop_session(proc: subprocess.Popen, grace_s: float = 3.0) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(grace_s)
    except ProcessLookupError:
        pass


def kill_namespace_pids(netns: str) -> None:
    """Whatever still runs inside the bed's own namespace was started through it."""
    done = ip("netns", "pids", netns, check=False)
    pids = [int(p) for p in done.stdout.split() if p.isdigit()]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 2
        while sig == signal.SIGTERM and time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def cleanup_stale() -> list[str]:
    """Remove beds whose owning process is gone; returns their run ids."""
    removed = []
    for path in sorted(STATE_DIR.glob("*.json")) if STATE_DIR.exists() else []:
        try:
            state = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        pid = int(state.get("pid", 0))
        if pid > 0 and _alive(pid):
            continue
        for netns, veth_root in state.get("hosts", {}).values():
            kill_namespace_pids(netns)
            ip("link", "del", veth_root, check=False)
            ip("netns", "del", netns, check=False)
        ip("link", "del", state.get("bridge", ""), check=False)
        path.unlink(missing_ok=True)
        removed.append(path.stem)
    return removed
