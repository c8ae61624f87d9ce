"""`splitserve serve --ray [ADDRESS]`: engines placed and restarted by Ray; the frontend stays here.

    serve (this process: the frontend, a Ray driver)
      ├─ ray.init(ADDRESS): join a cluster (`auto`, `HOST:6379`) or, without one, start a local Ray
      ├─ per engine: EngineActor.options(num_cpus=threads, resources={<role's resource>: share},
      │              max_restarts=N, name=engine id).remote(...)   (cluster/ray_engine.py)
      └─ engines dial back to --engine-address over ZeroMQ, exactly like local ones

`--ray-resource prefill=gpu_node` sends prefill engines only to nodes started with that custom
resource (`ray start --resources '{"gpu_node": 1}'`); each engine asks for a tiny share of it, so
it acts as a node label and does not limit how many engines a node takes (`num_cpus` does).
With `--topology`, Ray places every instance; one with a `host` goes to that Ray node (`node:IP`).

Off loopback (engines on other nodes) the links are secured by default: without
--engine-secret-file / --kv-secret-file serve generates the secrets (CurveZMQ on the engine link,
the HMAC handshake on KV sockets), hands them to the actors, and each prefill engine binds its
KV socket to its node's address. Ray carries only the actors' start arguments, never tokens or KV.
"""
from __future__ import annotations

import argparse
import asyncio
import atexit
import logging
import os
import secrets
import signal
import tempfile
from pathlib import Path

from splitserve.config import ROLES, EngineConfig
from splitserve.link_security import endpoint_host, engine_address_is_local
from splitserve.protocol import encode_engine_config

log = logging.getLogger("splitserve.ray")

INSTALL_HINT = "pip install -e '.[ray]'"
RESOURCE_SHARE = 0.001  # of a role's custom resource per engine: a label, not a quota
PROBE_INTERVAL_S = 0.5


def add_ray_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                   help="place engines on a Ray cluster (ADDRESS: 'auto', HOST:PORT; none: RAY_ADDRESS or a "
                        f"local Ray); Ray restarts an engine that dies. Needs `{INSTALL_HINT}`")
    p.add_argument("--ray-resource", action="append", default=[], metavar="ROLE=RESOURCE",
                   help="with --ray: put engines of ROLE only on nodes that have this custom resource "
                        "(repeatable, e.g. --ray-resource prefill=prefill --ray-resource decode=decode)")
    p.add_argument("--ray-max-restarts", type=int, default=3,
                   help="with --ray: times Ray restarts each engine after it dies (-1: without limit)")


def import_ray():
    try:
        import ray
    except ImportError:
        raise ValueError(f"--ray needs Ray, which is not installed: {INSTALL_HINT}") from None
    return ray


def role_resources(specs: list[str]) -> dict[str, str]:
    out = {}
    for spec in specs:
        role, sep, resource = spec.partition("=")
        if not sep or role not in ROLES or not resource:
            raise ValueError(f"--ray-resource {spec!r}: write ROLE=RESOURCE with ROLE one of {', '.join(ROLES)}, "
                             "e.g. --ray-resource prefill=prefill")
        out[role] = resource
    return out


def check_ray_args(args: argparse.Namespace) -> None:
    """Before anything starts; the secrets it may generate must exist before the links are built."""
    if args.ray is None:
        if args.ray_resource:
            raise ValueError("--ray-resource places engines on Ray; add --ray [ADDRESS]")
        return
    import_ray()
    args.ray_resources = role_resources(args.ray_resource)
    if args.ray_max_restarts < -1:
        raise ValueError(f"--ray-max-restarts must be -1 (no limit) or >= 0, got {args.ray_max_restarts}")
    if args.pin_cores:
        raise ValueError("--pin-cores pins this machine's cores; with --ray, Ray places engines: drop --pin-cores")
    if engine_address_is_local(args.engine_address):
        return
    if args.kv_transport == "shm":
        raise ValueError(f"--ray with --engine-address {args.engine_address}: engines may run on other hosts, "
                         "where shared memory cannot reach; add --kv-transport tcp")
    if args.engine_secret_file is None:
        args.engine_secret_file = _generated_secret_file("engine")
    if args.kv_secret_file is None:
        args.kv_secret_file = _generated_secret_file("kv")


def _generated_secret_file(what: str) -> Path:
    fd, path = tempfile.mkstemp(prefix=f"splitserve-{what}-secret-")  # mode 0600
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    atexit.register(os.unlink, path)
    log.info("generated the %s secret for engines off loopback", what)
    return Path(path)


def actor_options(engine_id: str, role: str, num_threads: int, resources: dict[str, str], host: str | None,
                  max_restarts: int) -> dict:
    wanted = {resources[role]: RESOURCE_SHARE} if role in resources else {}
    if host is not None:
        wanted[f"node:{host}"] = RESOURCE_SHARE  # Ray gives every node this resource
    return {"name": engine_id, "num_cpus": num_threads, "resources": wanted, "max_restarts": max_restarts}


class RayPlacement:
    """The Ray actors of one `serve`; they die with it (their owner), engines with them."""

    def __init__(self, args: argparse.Namespace, engine_address: str, extra_env: dict[str, str],
                 restart_delay_s: float) -> None:
        ray = import_ray()
        self.ray = ray
        on_term = signal.getsignal(signal.SIGTERM)
        ray.init(address=args.ray or None, namespace=f"splitserve-{os.getpid()}", include_dashboard=False,
                 logging_level=logging.WARNING)
        signal.signal(signal.SIGTERM, on_term)  # Ray's own handler would exit without stopping the engines
        from splitserve.cluster.ray_engine import EngineActor

        self._actor_class = ray.remote(EngineActor)
        here = ray.util.get_node_ip_address()
        self.off_loopback = not engine_address_is_local(engine_address)
        if not self.off_loopback:
            others = sorted({n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]} - {here})
            if others:
                raise ValueError(f"the Ray cluster has nodes on other hosts ({', '.join(others)}) that cannot "
                                 f"reach the loopback engine address {engine_address}; give --engine-address "
                                 f"tcp://{here}:0 --kv-transport tcp (the link secrets are then generated)")
        host = endpoint_host(engine_address)
        self.connect = engine_address.replace(host, here, 1) if host in ("0.0.0.0", "*") else engine_address
        secret_file = args.engine_secret_file if self.off_loopback else None
        self._engine_secret = Path(secret_file).read_bytes().strip() if secret_file is not None else None
        self._resources, self._max_restarts = args.ray_resources, args.ray_max_restarts
        self._env, self._restart_delay_s = extra_env, restart_delay_s
        self.actors: dict[str, object] = {}
        self._probes: dict[str, object] = {}

    def start(self, config: EngineConfig, host: str | None = None) -> None:
        options = actor_options(config.instance_id, config.role, config.num_threads or 1, self._resources, host,
                                self._max_restarts)
        actor = self._actor_class.options(**options).remote(
            self.connect, encode_engine_config(config), self._engine_secret, self._env, self.off_loopback,
            self._restart_delay_s)
        self.actors[config.instance_id] = actor

    def dead_for_good(self) -> list[str]:
        """Engines whose actor is gone and will not be restarted (cheap: one pending probe each)."""
        dead = []
        for engine_id, actor in self.actors.items():
            probe = self._probes.get(engine_id)
            if probe is None:
                self._probes[engine_id] = actor.engine_pid.remote()
                continue
            done, _ = self.ray.wait([probe], timeout=0)
            if not done:
                continue
            del self._probes[engine_id]
            try:
                self.ray.get(probe)
            except self.ray.exceptions.RayActorError:
                dead.append(engine_id)
        return dead

    async def wait_ready(self, client, engine_ids: list[str], timeout_s: float) -> None:
        """The frontend's wait, but an engine whose actor ran out of restarts fails serve at once."""
        ready = asyncio.ensure_future(client.wait_ready(engine_ids, timeout_s))
        while not ready.done():
            failed = [i for i in self.dead_for_good() if i not in client.instances]
            if failed:
                ready.cancel()
                raise RuntimeError(f"engines {failed} died during startup and Ray will not restart them again "
                                   f"(--ray-max-restarts {self._max_restarts}); their output above (or in the "
                                   "Ray worker logs) says why")
            await asyncio.wait({ready}, timeout=PROBE_INTERVAL_S)
        ready.result()

    # how a rolling restart (coordinator/rolling_restart.py) tells and ends the engines placed here

    def owns(self, engine_id: str, inst=None) -> bool:
        return engine_id in self.actors

    def stop_engine(self, engine_id: str, inst=None, timeout_s: float = 30.0) -> int | None:
        """A rolling restart's last step, once the engine was told to stop (or removed past its drain
        deadline): wait for its exit, then end the actor for good, so that Ray neither restarts it
        nor keeps its resources. The exit code, or None when the actor had already ended itself
        (its engine exited with 0) and the code went with it."""
        ray = self.ray
        actor = self.actors.pop(engine_id)
        self._probes.pop(engine_id, None)
        code = None
        try:
            code = ray.get(actor.wait.remote(timeout_s), timeout=timeout_s + 5)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass
        try:
            ray.kill(actor, no_restart=True)  # its engine sees its parent gone and exits
        except ValueError:
            pass  # already gone
        return code

    def stop(self, grace_s: float = 10.0) -> None:
        """After the frontend told every engine to shut down: let them exit, then end the actors."""
        ray = self.ray
        waits = [actor.wait.remote(grace_s) for actor in self.actors.values()]
        if waits:
            ray.wait(waits, num_returns=len(waits), timeout=grace_s + 2)
        for actor in self.actors.values():
            ray.kill(actor, no_restart=True)
        ray.shutdown()
