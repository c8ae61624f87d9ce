"""`splitserve serve`: start N engine processes and the frontend, and stop them all cleanly.

    this process = the frontend (asyncio: uvicorn + EngineClient)
      ├─ build each engine's EngineConfig once, spawn engine-0 .. engine-N-1
      │    (`splitserve engine --connect <frontend> --parent-pid <us> --config-stdin`, the config
      │    msgspec-encoded on its stdin: never turned back into flags; it carries the engine-link
      │    and KV secrets, generated unless given as files: link_security.own_engine_secrets)
      ├─ load the tokenizer while they load the model
      ├─ wait until every engine said hello, then serve HTTP and print the URL
      │    (--api-server-count N > 1: first start N-1 more HTTP processes on the port; api_hub.py)
      ├─ SIGINT/SIGTERM: stop HTTP, tell engines to shut down, wait, then terminate stragglers
      └─ POST /admin/coordinator/restart: end what is in flight, stop HTTP, re-execute this same
           command in this same process, engines kept (coordinator_restart.py)

Engines watch our pid too: if this process is killed outright, they exit on their own.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
import time

from splitserve.cluster.ray_placement import RayPlacement, add_ray_arguments, check_ray_args
from splitserve.config import EngineConfig
from splitserve.coordinator.adaptive import add_adaptive_arguments, adaptive_from_args, check_adaptive_args
from splitserve.coordinator.disagg_policy import add_disagg_arguments, check_disagg_args, disagg_policy_from_args
from splitserve.engine.process import add_engine_arguments, engine_config_from_args
from splitserve.api.http_guard import add_http_guard_arguments, http_guard_from_args
from splitserve.api.limits import add_limit_arguments, check_limit_args
from splitserve.api.api_keys import add_api_key_arguments, api_keys_from_args
from splitserve.link_security import add_engine_link_arguments, engine_link_from_args, own_engine_secrets
from splitserve.entrypoints.api_hub import stop_processes
from splitserve.entrypoints.coordinator_restart import (AdoptedProcess, CloseWhileRestarting, CoordinatorRestart,
                                                        exec_with_handover, take_handover)
from splitserve.entrypoints.state_file import ArrangementWatcher, check_state_path, restore_arrangement
from splitserve.api.tool_parsers import TOOL_PARSERS
from splitserve.entrypoints.topology import hand_start_command, load_topology
from splitserve.kv_transfer import kv_config_from_args
from splitserve.protocol import encode_engine_config

log = logging.getLogger("splitserve.serve")


def kernel_rows_arg(text: str) -> int | None:
    """serve --kernel-rows: 'auto' (None: each engine measures) or a whole number of rows."""
    if text.strip().lower() == "auto":
        return None
    try:
        rows = int(text)
    except ValueError:
        rows = -1
    if rows < 0:
        raise argparse.ArgumentTypeError(f"--kernel-rows takes 'auto' or a whole number >= 0, got {text!r}")
    return rows


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="HTTP address (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--instances", type=int, default=None,
                   help="colocated engine processes (data parallel; default 1)")
    p.add_argument("--prefill", type=int, default=0, help="prefill engine processes (disaggregated; needs --decode)")
    p.add_argument("--decode", type=int, default=0, help="decode engine processes (disaggregated; needs --prefill)")
    p.add_argument("--topology", default=None,
                   help="YAML file naming the instances (id, role, host); see splitserve/entrypoints/topology.py")
    p.add_argument("--prefix-affinity", action="store_true",
                   help="send prompts sharing their first 64 tokens to the instance that prefilled them before")
    p.add_argument("--max-queued-requests", type=int, default=256,
                   help="per engine, beyond --max-num-seqs; more gets 429 with Retry-After")
    p.add_argument("--pin-cores", action="store_true",
                   help="pin engine i to its own --threads-per-instance cores")
    p.add_argument("--engine-address", default="tcp://127.0.0.1:0",
                   help="where engines connect (ZeroMQ endpoint; default: loopback, ephemeral port)")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for engines")
    p.add_argument("--log-level", default="info")
    p.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default="hermes",
                   help="how the model writes tool calls (hermes: <tool_call>{...}</tool_call>, Qwen2/Qwen3)")
    p.add_argument("--retry-on-engine-failure", type=int, default=1,
                   help="times a request is sent to another instance when its engine dies before any "
                        "token reached the client (0: fail it at once)")
    p.add_argument("--omp-wait-policy", choices=("auto", "active", "passive"), default="auto",
                   help="OpenMP threads of each engine: spin (active) or sleep (passive) between parallel "
                        "regions. auto: passive when the engines' threads fill every core, so the frontend "
                        "and other processes must share them (measured: a 2-thread 8-stream step 285 ms "
                        "spinning vs 140 ms passive beside one busy process; 69 vs 82 ms on an idle box). "
                        "An OMP_WAIT_POLICY already in the environment wins")
    p.add_argument("--kernels", choices=("auto", "off"), default="auto",
                   help="off: engines run the pure-torch path even where the C++ kernels are built "
                        "(with --weight-format fp32: the engine before issue 16, for before/after trials)")
    p.add_argument("--kernel-rows", type=kernel_rows_arg, default=None, metavar="auto|N",
                   help="GGUF block matrices: rows of activations up to which the C++ kernel multiplies by "
                        "the blocks; past them the matrix is dequantized for an fp32 GEMM. auto: each engine "
                        "times both paths per matrix shape when it loads (under a second; the crossing is "
                        "64 rows on one AVX-512 EPYC, about 30 on an AMX Xeon). Results do not depend on it")
    p.add_argument("--engine-silence-timeout", type=float, default=1.5,
                   help="seconds without a message (engines send one every 0.25 s) before an engine is "
                        "declared dead and its requests are retried or failed")
    p.add_argument("--api-server-count", type=int, default=1,
                   help="HTTP processes behind the one port, each rendering, tokenizing and detokenizing "
                        "(SO_REUSEPORT spreads connections over them); this process stays the only one "
                        "that talks to the engines, and the others hand it token ids")
    p.add_argument("--state-file", default=None, metavar="PATH",
                   help="keep the arrangement (instances and roles, as the admin API and the mix controller "
                        "change it) in this JSON file, and start from it when it exists and is for the same "
                        "model, instead of the command line's (default: none, nothing kept)")
    add_api_key_arguments(p)
    add_http_guard_arguments(p)
    add_limit_arguments(p)
    add_engine_link_arguments(p)
    p.set_defaults(generated_secrets=False)  # run() sets it (own_engine_secrets)
    add_adaptive_arguments(p)
    add_disagg_arguments(p)
    add_ray_arguments(p)


def check_args(args: argparse.Namespace) -> None:
    disaggregated = args.prefill or args.decode
    args.topology_spec = None
    if args.topology is not None:
        if disaggregated or args.instances is not None:
            raise ValueError("--topology names every instance; leave out --instances, --prefill and --decode")
        args.topology_spec = load_topology(args.topology)
        if args.topology_spec.engine_address:
            args.engine_address = args.topology_spec.engine_address
        args.instances = 0
        if sum(i.role == "prefill" for i in args.topology_spec.local) > 1 and args.kv_port != 0:
            raise ValueError("--kv-port cannot be shared by several local prefill instances; leave it at 0")
        return check_common(args)
    if disaggregated and args.instances is not None:
        raise ValueError("--instances (colocated engines) cannot be mixed with --prefill/--decode; "
                         "use either --instances N or --prefill N --decode M")
    if disaggregated and (args.prefill < 1 or args.decode < 1):
        raise ValueError(f"disaggregated serving needs at least one of each: --prefill {args.prefill} "
                         f"--decode {args.decode}; give both --prefill N and --decode M (N, M >= 1)")
    if args.prefill > 1 and args.kv_port != 0:
        raise ValueError(f"--kv-port {args.kv_port} cannot be shared by {args.prefill} prefill instances; "
                         "leave --kv-port at 0 (each picks a free port and advertises it)")
    if args.instances is None:
        args.instances = 0 if disaggregated else 1
    if args.instances < 1 and not disaggregated:
        raise ValueError(f"--instances must be >= 1, got {args.instances}")
    check_common(args)


def check_common(args: argparse.Namespace) -> None:
    if args.api_server_count < 1:
        raise ValueError(f"--api-server-count must be >= 1 (the number of HTTP processes), got "
                         f"{args.api_server_count}")
    if not args.engine_silence_timeout > 0.5:
        raise ValueError(f"--engine-silence-timeout must be above 0.5 s (engines send a heartbeat every "
                         f"0.25 s), got {args.engine_silence_timeout}")
    if args.retry_on_engine_failure < 0:
        raise ValueError(f"--retry-on-engine-failure must be >= 0, got {args.retry_on_engine_failure}")
    if args.max_queued_requests < 0:
        raise ValueError(f"--max-queued-requests must be >= 0, got {args.max_queued_requests}")
    if args.threads_per_instance is not None and args.threads_per_instance < 1:
        raise ValueError(f"--threads-per-instance must be >= 1, got {args.threads_per_instance}")
    if args.state_file is not None:
        check_state_path(args.state_file)


def core_sets(instances: int, threads: int) -> list[str]:
    cores = sorted(os.sched_getaffinity(0))
    if instances * threads > len(cores):
        raise ValueError(f"--pin-cores needs {instances} x {threads} cores but only {len(cores)} are "
                         f"available; lower --instances or --threads-per-instance, or drop --pin-cores")
    return [",".join(str(c) for c in cores[i * threads:(i + 1) * threads]) for i in range(instances)]


def engine_roles(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(engine_id, role) of every engine `serve` starts (with --ray, Ray places a topology's remote ones too)."""
    if getattr(args, "topology_spec", None) is not None:
        spec = args.topology_spec
        return [(i.id, i.role) for i in (spec.instances if args.ray is not None else spec.local)]
    if args.prefill or args.decode:
        return ([(f"prefill-{i}", "prefill") for i in range(args.prefill)]
                + [(f"decode-{i}", "decode") for i in range(args.decode)])
    return [(f"engine-{i}", "colocated") for i in range(args.instances)]


def engine_env(args: argparse.Namespace, num_engines: int) -> dict[str, str]:
    """The environment engines start with: OpenMP must learn its wait policy before torch loads."""
    env = dict(os.environ)
    if "OMP_WAIT_POLICY" in env:
        return env
    policy = args.omp_wait_policy
    if policy == "auto":
        threads = args.threads_per_instance or 1
        fills = threads > 1 and threads * num_engines >= len(os.sched_getaffinity(0))
        policy = "passive" if fills else None
    if policy is not None:
        env["OMP_WAIT_POLICY"] = policy.upper()
    return env


def engine_command(args: argparse.Namespace, address: str, cpus: str | None) -> list[str]:
    """The engine's process settings; its EngineConfig goes to its stdin (start_engine_process)."""
    cmd = [sys.executable, "-m", "splitserve.cli", "engine", "--connect", address, "--parent-pid", str(os.getpid()),
           "--config-stdin"]
    if cpus:
        cmd += ["--cpus", cpus]
    return cmd  # the engine link's secret, like the KV one, is in the EngineConfig


def start_engine_process(args: argparse.Namespace, config: EngineConfig, address: str, cpus: str | None,
                 env: dict[str, str]) -> subprocess.Popen:
    proc = subprocess.Popen(engine_command(args, address, cpus), env=env, stdin=subprocess.PIPE)
    try:
        proc.stdin.write(encode_engine_config(config))  # keeps the link and KV secrets out of `ps`
        proc.stdin.close()
    except BrokenPipeError:
        pass  # it died at once; wait_ready reports its exit code
    return proc


def stop_engines(processes: list[subprocess.Popen], grace_s: float = 10.0) -> None:
    stop_processes(processes, grace_s, what="engine")


def http_listener(args: argparse.Namespace, handover) -> socket.socket:
    """The listening socket all HTTP traffic arrives on: the one the process we replaced kept open
    for us (a coordinator restart), or a new one. Bound here, not in uvicorn, so that a restart can
    keep it open. OSError when the port is taken."""
    from splitserve.api.listen import http_socket, listening_socket

    if handover is not None and handover.http_fd is not None:
        inherited = socket.socket(fileno=handover.http_fd)
        inherited.set_inheritable(False)
        return inherited
    try:
        if args.api_server_count > 1:  # shared with the other API processes (SO_REUSEPORT)
            return listening_socket(args.host, args.port, first=True)
        return http_socket(args.host, args.port)
    except OSError as e:
        raise OSError(f"cannot listen on {args.host}:{args.port}: {e.strerror}") from e


async def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from splitserve.api.api_server import ApiServerHeader, build_server_app
    from splitserve.api.engine_client import EngineClient
    from splitserve.api.render import load_renderer
    from splitserve.coordinator.metrics import FrontendMetrics
    from splitserve.coordinator.router import Router
    from splitserve.entrypoints.api_hub import ApiHub

    roles = engine_roles(args)
    spec = args.topology_spec
    remote = spec.remote if spec is not None and args.ray is None else []
    handover = getattr(args, "handover", None)  # the process we replaced (a coordinator restart), or None
    adopted = {e.id: e for e in handover.engines} if handover is not None else {}
    if handover is not None:  # the engines still running, with their roles now: not a fresh start
        roles = [(e.id, e.role) for e in handover.engines]
    elif args.state_file is not None:
        roles = restore_arrangement(args.state_file, args.model, roles, {i.id for i in remote}, args.kv_port)
    # the state file's arrangement is made of these, in the order serve started them (a dict as an ordered set)
    owned = dict.fromkeys(engine_id for engine_id, _ in roles)
    # The HTTP port is taken before any engine starts, as vLLM does: a port in use fails here, in
    # a second, not after the model loaded; and the ephemeral ports the engine link and KV sockets
    # bind meanwhile cannot land on it (a test's free port was once taken so between its pick and
    # the late bind). Connections made before the app is up wait in the backlog.
    listener = http_listener(args, handover)
    if args.threads_per_instance is None and roles:
        # Unset, every engine would start one torch thread per core and they would fight over
        # them; split the cores this process may use evenly instead.
        args.threads_per_instance = max(1, len(os.sched_getaffinity(0)) // len(roles))
    cpus = core_sets(len(roles), args.threads_per_instance or 1) if args.pin_cores else [None] * len(roles)
    metrics, router = FrontendMetrics(), Router(prefix_affinity=args.prefix_affinity)
    link = engine_link_from_args(args, args.engine_address, "--engine-address")
    # before any engine config is built: it sizes the decode instances' local prefill chunks
    disagg_policy = disagg_policy_from_args(args, metrics)
    client = EngineClient(None, router, metrics, bind=args.engine_address,
                          max_queued_requests=args.max_queued_requests, link=link,
                          retry_on_engine_failure=args.retry_on_engine_failure,
                          heartbeat_timeout_s=args.engine_silence_timeout, disagg_policy=disagg_policy)
    engine_ids = [engine_id for engine_id, _ in roles] + [i.id for i in remote]
    if handover is not None:
        metrics.coordinator_restarts.inc(handover.restarts)
        metrics.coordinator_restart_failed.inc(handover.failed_requests)
    for instance in remote:
        print(f"splitserve: waiting for {instance.id} ({instance.role}) on {instance.host}; run there: "
              f"{hand_start_command(instance, client.address, args.model)}", flush=True)
    processes = []
    placement: RayPlacement | None = None
    mix = hub = watcher = restarter = None

    ray_hosts = {i.id: i.host for i in spec.remote} if spec is not None else {}

    def place(engine_id: str, role: str, cores: str | None = None) -> None:
        config = engine_config_from_args(args, role, engine_id)
        owned[engine_id] = None
        if placement is not None:
            placement.start(config, ray_hosts.get(engine_id))
            return
        proc = start_engine_process(args, config, client.address, cores, engine_env(args, len(roles)))
        processes.append(proc)
        client.attach_process(engine_id, proc)

    try:
        if args.ray is not None:
            env = {k: v for k, v in engine_env(args, len(roles)).items() if os.environ.get(k) != v}
            # a restarted engine's hello must come after the frontend declared its predecessor dead
            placement = RayPlacement(args, client.address, env, args.engine_silence_timeout + 0.5)
        for (engine_id, role), cores in zip(roles, cpus):
            if engine_id in adopted:  # our child still, with its model loaded: it rejoins on its own
                proc = AdoptedProcess(adopted[engine_id].pid)
                processes.append(proc)
                client.attach_process(engine_id, proc)
            else:
                place(engine_id, role, cores)
        client.start()
        # The tokenizer loads here while the engines load the model in their processes.
        client.renderer = await asyncio.to_thread(load_renderer, args.model, args.tool_call_parser)
        if placement is not None:
            await placement.wait_ready(client, engine_ids, args.startup_timeout)
        else:
            await client.wait_ready(engine_ids, args.startup_timeout)
        counters: dict[str, int] = {}

        def spawn_engine(role: str, engine_id: str | None = None) -> str:  # POST /admin/instances, a restart
            while engine_id is None or engine_id in owned or engine_id in client.instances:
                counters[role] = counters.get(role, 0) + 1  # a restored arrangement may hold earlier ones
                engine_id = f"{role}-added-{counters[role]}"
            place(engine_id, role)
            return engine_id

        if args.state_file is not None:
            watcher = ArrangementWatcher(client, args.state_file, args.model, owned)
            watcher.start()
        if handover is not None:
            log.warning("coordinator restarted in place in %.1f s: engines %s rejoined with their model loaded "
                        "(restart %d of this serve; %d requests in flight were ended by the restarts)",
                        time.time() - handover.requested_at, ", ".join(adopted) or "(none)", handover.restarts,
                        handover.failed_requests)
        mix = adaptive_from_args(args, client, metrics, len(engine_ids))
        refused = None
        if placement is not None:
            refused = ("the engines are Ray actors of this process: a restart in place would take them down; "
                       "restart serve --ray itself")
        elif sys.argv[1:2] != ["serve"]:
            refused = "this server was not started as `splitserve serve ...`, so it cannot re-execute itself"
        restarter = CoordinatorRestart(client, args, refused)
        restarter.previous = handover
        app, http_limits = build_server_app(client, metrics, spawn_engine, args, mix, restarter, placement)
        app = CloseWhileRestarting(app, restarter)
        sockets = [listener]
        if args.api_server_count > 1:
            hub = ApiHub(client, app)
            hub.start()
            hub.start_processes(args.api_server_count, args, sockets[0].getsockname()[1])
            await hub.wait_ready(args.startup_timeout)
            app = ApiServerHeader(app, 0)
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                lifespan="off", access_log=False, timeout_graceful_shutdown=5, **http_limits)
        server = uvicorn.Server(config)
        restarter.http_fd = sockets[0].fileno()
        restarter.stop_serving = lambda: setattr(server, "should_exit", True)

        def stop_accepting() -> None:
            for listener in getattr(server, "servers", []):
                listener.close()

        restarter.stop_accepting = stop_accepting

        async def announce() -> None:
            while not server.started:
                await asyncio.sleep(0.05)
            api = f" and {args.api_server_count} API processes" if args.api_server_count > 1 else ""
            print(f"splitserve: serving {client.model_name!r} on http://{args.host}:{listener.getsockname()[1]}/v1 "
                  f"with {len(roles)} engine(s): {', '.join(f'{i} ({r})' for i, r in roles)}{api}; "
                  f"engines join at {client.address}", flush=True)
            if args.generated_secrets:
                print("splitserve: the engine link and KV sockets use secrets generated for these engines; "
                      "to add engines by hand, start serve with --engine-secret-file and --kv-secret-file",
                      flush=True)

        announcer = asyncio.create_task(announce())
        if mix is not None:
            mix.start()
        await server.serve(sockets=sockets)
        announcer.cancel()
    finally:
        restarting = restarter is not None and restarter.handover is not None
        listener.close()  # a restart has handed a duplicate of it to the next process
        if watcher is not None:
            await watcher.stop()  # before the engines stop: their exits change nothing
        if hub is not None:
            await hub.close()
        if mix is not None:
            await mix.stop()
        await client.shutdown(shutdown_engines=not restarting)
        if restarting:
            args.restart_handover = restarter.handover  # run() re-executes once the loop is closed
            log.warning("coordinator restart: HTTP stopped; engines %s keep running",
                        ", ".join(e.id for e in restarter.handover.engines) or "(none)")
        else:
            await asyncio.to_thread(stop_engines, processes)
            if placement is not None:
                placement.stop()
            log.warning("all engines stopped")
    return 0


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        check_args(args)
        check_ray_args(args)
        check_limit_args(args)
        check_disagg_args(args)
        check_adaptive_args(args)
        # an unreadable key file or a bad key fails here, before any engine starts
        http_guard_from_args(args, api_keys_from_args(args))
        engine_link_from_args(args, args.engine_address, "--engine-address")
        spec = args.topology_spec
        args.generated_secrets = own_engine_secrets(args, hand_started=bool(spec and spec.remote and args.ray is None))
        args.handover, args.restart_handover = take_handover(), None
        if args.handover is not None:  # a coordinator restart: the engines know the old secrets and address
            args.engine_address = args.handover.engine_address
            args.generated_secrets = args.handover.generated_secrets
            if args.handover.link_secret is not None:
                args.engine_link_secret = args.handover.link_secret
            if args.handover.kv_secret is not None:
                args.kv_secret = args.handover.kv_secret
        kv_config_from_args(args)  # a bad --kv-* value fails here, not in N engine processes
    except ValueError as e:
        print(f"splitserve serve: {e}", file=sys.stderr)
        return 2

    def on_term(signum, frame):  # before uvicorn installs its own handlers: stop like Ctrl-C
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    try:
        code = asyncio.run(serve(args))
    except KeyboardInterrupt:
        return 0
    except (RuntimeError, TimeoutError, OSError, ValueError) as e:  # startup failed: no model, dead engine
        print(f"splitserve serve: {e}", file=sys.stderr)
        return 1
    if args.restart_handover is not None:
        exec_with_handover(args.restart_handover)  # does not return
    return code
