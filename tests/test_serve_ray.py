"""`splitserve serve --ray`: engines placed and restarted by Ray, serving like local ones.

One Ray instance per module (a local `ray.init` costs seconds), with the custom resources
`prefill` and `decode`; a `serve --ray` 1P1D joins it, placing each role by its resource, and a
local 1P1D gives the reference answers (tiny random-weight model, greedy).
- Its greedy answers equal the local arrangement's, each KV transfer ok; each engine runs under a
  Ray actor holding `num_cpus` = its threads and a share of its role's resource.
- SIGKILL an engine: Ray restarts it, the frontend admits it back, and once a role change restores
  1P1D (a survivor took the stage over meanwhile) the answers are the same again.
- A rolling restart (`splitserve admin restart --all`) under a steady load fails no request: each
  engine gets a new actor under a new id, and the old actors end for good, their shares free.
- A drained engine's actor ends for good: Ray does not restart it, and its resources are free.
- Without Ray installed, `--ray` exits with one line saying how to install it (runs always).
"""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from serve_disagg_support import DisaggServer
from serve_support import REPO, wait_until
from splitserve.cluster.ray_placement import RESOURCE_SHARE, actor_options, role_resources
from test_rolling_restart import rolling_restart
from test_serve_disagg import answer_all, mixed_requests
from tiny_models import write_tiny_checkpoint

try:
    import ray
except ImportError:
    ray = None

needs_ray = pytest.mark.skipif(ray is None, reason="Ray is not installed (pip install -e '.[ray]')")
RESOURCES = {"prefill": 1.0, "decode": 1.0}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(write_tiny_checkpoint(tmp_path_factory.mktemp("ray") / "tiny", arch="llama"))


@pytest.fixture(scope="module")
def ray_address():
    ray.init(num_cpus=4, resources=RESOURCES, include_dashboard=False, logging_level="warning")
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="module")
def servers(model, ray_address, tmp_path_factory):
    root = tmp_path_factory.mktemp("logs")
    pair = ("--prefill", "1", "--decode", "1", "--kv-transport", "tcp")
    on_ray = DisaggServer(model, *pair, "--ray", ray_address, "--ray-resource", "prefill=prefill",
                          "--ray-resource", "decode=decode", log_path=root / "ray.log")
    local = DisaggServer(model, *pair, log_path=root / "local.log")
    try:
        yield on_ray.wait_ready(), local.wait_ready()
    finally:
        local.stop()
        assert on_ray.stop() == 0, on_ray.log()  # Ray's own SIGTERM handler once made this 15


def instances(server) -> dict[str, dict]:
    rows = httpx.get(server.base_url + "/admin/instances", timeout=5).json()["instances"]
    return {row["id"]: row for row in rows}


def parent_command(pid: int) -> str:
    ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    return Path(f"/proc/{ppid}/cmdline").read_bytes().decode(errors="replace")


def assert_same_answers(server, local, seed: int) -> None:
    bodies = mixed_requests(seed=seed, n=6)
    got, want = asyncio.run(answer_all(server.base_url, bodies)), asyncio.run(answer_all(local.base_url, bodies))
    assert [(a["text"], a["num_tokens"]) for a in got] == [(a["text"], a["num_tokens"]) for a in want]
    for body, a in zip(bodies, got):
        if body["max_tokens"] > 1:  # a one-token answer never reaches the decode instance
            assert a["report"]["kv_transfer"]["outcome"] == "ok", a


def test_actor_options_ask_for_threads_role_resource_and_host():
    assert actor_options("p0", "prefill", 2, {"prefill": "fast"}, "10.0.0.2", 3) == {
        "name": "p0", "num_cpus": 2, "max_restarts": 3,
        "resources": {"fast": RESOURCE_SHARE, "node:10.0.0.2": RESOURCE_SHARE}}
    assert actor_options("d0", "decode", 1, {"prefill": "fast"}, None, 0)["resources"] == {}
    with pytest.raises(ValueError, match="ROLE=RESOURCE"):
        role_resources(["prefill"])
    with pytest.raises(ValueError, match="ROLE=RESOURCE"):
        role_resources(["gpu=fast"])


def test_with_ray_a_topology_places_every_instance_remote_ones_on_their_node(tmp_path):
    from test_serve_disagg_router import serve_args

    path = tmp_path / "topo.yaml"
    path.write_text("instances:\n  - {id: p0, role: prefill}\n  - {id: d-far, role: decode, host: 10.0.0.7}\n")
    launch, args = serve_args("--topology", str(path), "--ray")
    launch.check_args(args)
    assert launch.engine_roles(args) == [("p0", "prefill"), ("d-far", "decode")]
    far = args.topology_spec.remote[0]
    assert actor_options(far.id, far.role, 1, {}, far.host, 3)["resources"] == {"node:10.0.0.7": RESOURCE_SHARE}


@needs_ray
def test_off_loopback_ray_generates_both_link_secrets_and_needs_tcp_kv():
    from splitserve.cluster.ray_placement import check_ray_args
    from splitserve.kv_transfer import kv_config_from_args
    from test_serve_disagg_router import serve_args

    off_host = ("--prefill", "1", "--decode", "1", "--ray", "--engine-address", "tcp://10.0.0.1:0")
    launch, args = serve_args(*off_host)
    launch.check_args(args)
    with pytest.raises(ValueError, match="--kv-transport tcp"):
        check_ray_args(args)
    launch, args = serve_args(*off_host, "--kv-transport", "tcp")
    launch.check_args(args)
    check_ray_args(args)
    for path in (args.engine_secret_file, args.kv_secret_file):
        assert (path.stat().st_mode & 0o777) == 0o600 and len(path.read_text()) == 64
    assert args.engine_secret_file.read_text() != args.kv_secret_file.read_text()
    assert kv_config_from_args(args).secret == args.kv_secret_file.read_bytes()


def test_ray_without_ray_installed_says_how_to_install_it():
    code = "import sys; sys.modules['ray'] = None; from splitserve.cli import main; raise SystemExit(main())"
    out = subprocess.run([sys.executable, "-c", code, "serve", "--ray"], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "pip install -e '.[ray]'" in out.stderr, out.stderr


@needs_ray
def test_ray_places_engines_by_role_and_serves_the_local_arrangements_tokens(servers):
    on_ray, local = servers
    assert_same_answers(on_ray, local, seed=1)
    rows = instances(on_ray)
    assert {i: r["role"] for i, r in rows.items()} == {"prefill-0": "prefill", "decode-0": "decode"}
    for row in rows.values():
        assert parent_command(row["pid"]).startswith("ray::EngineActor")
    free = ray.available_resources()
    assert free["prefill"] == pytest.approx(1 - RESOURCE_SHARE) and free["decode"] == pytest.approx(1 - RESOURCE_SHARE)
    assert free["CPU"] == pytest.approx(4 - 2)  # one thread each


@needs_ray
def test_ray_restarts_a_killed_engine_and_it_serves_again(servers):
    on_ray, local = servers
    old_pid = instances(on_ray)["decode-0"]["pid"]
    os.kill(old_pid, signal.SIGKILL)

    def restarted() -> bool:
        row = instances(on_ray)["decode-0"]
        return row["alive"] and row["pid"] != old_pid

    assert wait_until(restarted, timeout_s=180, interval_s=0.5), on_ray.log()
    assert parent_command(instances(on_ray)["decode-0"]["pid"]).startswith("ray::EngineActor")
    # prefill-0 took the decode stage over while decode-0 was missing; hand it back
    assert wait_until(lambda: not instances(on_ray)["prefill-0"]["changing_role"], timeout_s=30)
    r = httpx.post(on_ray.base_url + "/admin/instances/prefill-0/role", json={"role": "prefill"}, timeout=60)
    assert r.status_code == 200, r.text
    assert_same_answers(on_ray, local, seed=2)


def actor_gone(server, name: str) -> bool:
    try:
        ray.get_actor(name, namespace=f"splitserve-{server.proc.pid}")
    except ValueError:
        return True
    return False


@needs_ray
def test_a_rolling_restart_under_ray_replaces_each_actor_and_fails_no_request(servers, tmp_path):
    """Each engine gets a replacement actor (same role, new id) before its old one drains; the old
    actors end for good (Ray does not restart them) and give their shares back."""
    on_ray, local = servers
    out = rolling_restart(on_ray, tmp_path, "1P1D under Ray")
    assert "prefill-0 -> prefill-0.r1 (prefill)" in out and "decode-0 -> decode-0.r1 (decode)" in out
    for old, new in (("prefill-0", "prefill-0.r1"), ("decode-0", "decode-0.r1")):
        assert wait_until(lambda: actor_gone(on_ray, old), timeout_s=30), on_ray.log()
        assert not actor_gone(on_ray, new)
        assert parent_command(instances(on_ray)[new]["pid"]).startswith("ray::EngineActor")

    def shares_back() -> bool:
        free = ray.available_resources()
        return (free.get("prefill") == pytest.approx(1 - RESOURCE_SHARE)
                and free.get("decode") == pytest.approx(1 - RESOURCE_SHARE) and free.get("CPU") == pytest.approx(2))

    assert wait_until(shares_back, timeout_s=20), ray.available_resources()
    assert_same_answers(on_ray, local, seed=3)


@needs_ray
def test_a_drained_ray_engine_is_not_restarted(servers):
    """Last in the module: it leaves the server without a decode instance."""
    on_ray, _ = servers
    decode = next(i for i, row in instances(on_ray).items() if row["alive"] and row["role"] == "decode")
    assert httpx.delete(f"{on_ray.base_url}/admin/instances/{decode}", timeout=10).status_code == 202
    assert wait_until(lambda: actor_gone(on_ray, decode), timeout_s=60), on_ray.log()
    # the resources Ray reports lag a little: the decode engine's share is free once it catches up
    assert wait_until(lambda: ray.available_resources()["decode"] == pytest.approx(1.0), 10)
    assert not instances(on_ray)[decode]["alive"]
