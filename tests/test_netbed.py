"""The multi-host bed: namespaces that reach each other, shaped links, links taken down, and a
teardown that leaves nothing behind (also after an exception)."""
import subprocess
import sys
import time

import pytest

from splitserve.testbed.netbed import LinkSpec, NetBed, NetbedUnavailable, qdisc_available, unavailable_reason

REASON = unavailable_reason()
needs_netns = pytest.mark.skipif(REASON is not None, reason=f"no network namespaces here: {REASON}")

_CONNECT = ("import socket,sys\n"
            "try:\n"
            "    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1.5).sendall(b'hi')\n"
            "    print('connected')\n"
            "except OSError as e:\n"
            "    print('refused' if isinstance(e, ConnectionRefusedError) else 'unreachable')\n")
_SERVE = ("import socket,sys\n"
          "s = socket.create_server(('0.0.0.0', int(sys.argv[1])))\n"
          "print('up', flush=True)\n"
          "while True:\n"
          "    s.accept()[0].close()\n")


def _netns_exists(name: str) -> bool:
    return name in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def _link_exists(name: str) -> bool:
    return subprocess.run(["ip", "link", "show", name], capture_output=True).returncode == 0


def _serve(bed: NetBed, host: str, port: int) -> subprocess.Popen:
    proc = bed.popen(host, [sys.executable, "-c", _SERVE, str(port)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "up"
    return proc


def _connect(bed: NetBed, src: str, dst: str, port: int) -> str:
    return bed.run(src, [sys.executable, "-c", _CONNECT, bed.hosts[dst].address, str(port)]).stdout.strip()


def test_link_spec_reads_tc_rates_and_refuses_nonsense():
    assert LinkSpec.parse("100mbit").rate_bps == 100_000_000
    assert LinkSpec.parse("10gbit").label == "10gbit"
    assert LinkSpec.parse("1gbit", delay_ms=2).label == "1gbit+2ms"
    with pytest.raises(ValueError, match="e.g. 100mbit"):
        LinkSpec.parse("fast")
    with pytest.raises(ValueError, match="1mbit .. 100gbit"):
        LinkSpec.parse("1kbit")
    with pytest.raises(ValueError, match="not in hosts"):
        NetBed(("a", "b"), links={"c": LinkSpec()})


@needs_netns
def test_hosts_reach_each_other_and_the_root_namespace_then_vanish():
    with NetBed(("a", "b", "c")) as bed:
        names = [h.netns for h in bed.hosts.values()]
        _serve(bed, "b", 7001)
        assert _connect(bed, "a", "b", 7001) == "connected"
        assert _connect(bed, "c", "b", 7001) == "connected"
        assert _connect(bed, "a", "c", 7001) == "refused"     # reachable, nothing listening
        # the root namespace (where a frontend runs) reaches a host through the bridge
        out = subprocess.run([sys.executable, "-c", _CONNECT, bed.hosts["b"].address, "7001"],
                             capture_output=True, text=True).stdout.strip()
        assert out == "connected"
    assert not any(_netns_exists(n) for n in names)
    assert not _link_exists(bed.bridge)


@needs_netns
def test_teardown_after_an_exception_removes_processes_namespaces_and_bridge():
    with pytest.raises(RuntimeError, match="boom"):
        with NetBed(("a", "b")) as bed:
            server = _serve(bed, "a", 7002)
            raise RuntimeError("boom")
    assert server.poll() is not None
    assert not _netns_exists(bed.hosts["a"].netns) and not _link_exists(bed.bridge)
    assert not _link_exists(bed.hosts["a"].veth_root)


@needs_netns
def test_two_beds_at_once_do_not_collide():
    with NetBed(("a", "b")) as one, NetBed(("a", "b")) as two:
        assert one.run_id != two.run_id and one.subnet != two.subnet
        _serve(one, "b", 7003)
        assert _connect(one, "a", "b", 7003) == "connected"


@needs_netns
def test_link_down_cuts_a_host_off_and_link_up_brings_it_back():
    with NetBed(("a", "b")) as bed:
        _serve(bed, "b", 7004)
        bed.link_down("b")
        assert _connect(bed, "a", "b", 7004) == "unreachable"
        bed.link_up("b")
        deadline = time.monotonic() + 5
        while _connect(bed, "a", "b", 7004) != "connected":   # the bridge port relearns
            assert time.monotonic() < deadline, "b did not come back after link_up"


@needs_netns
def test_shaped_link_holds_a_bulk_flow_near_its_rate():
    with NetBed(("a", "b"), LinkSpec.parse("100mbit")) as bed:
        with bed.bulk_flow("a", "b") as flow:
            time.sleep(1.0)
    assert flow.bytes > 0
    # tbf lets a 64 KiB burst through, never twice the rate for a whole second
    assert flow.rate_bps < 200e6


@needs_netns
@pytest.mark.skipif(qdisc_available("netem") if REASON is None else True,
                    reason="this kernel has netem (or no netns): the refusal does not apply")
def test_a_delay_without_netem_is_refused_not_dropped():
    with pytest.raises(NetbedUnavailable, match="netem"):
        NetBed(("a", "b"), LinkSpec.parse("1gbit", delay_ms=5)).open()
