"""`splitserve serve`: start N engine processes and the frontend, and stop them all cleanly.

    this process = the frontend (asyncio: uvicorn + EngineClient)
      ├─ spawn engine-0 .. engine-N-1  (`splitserve engine --connect <frontend> --parent-pid <us>`)
      ├─ load the tokenizer while they load the model
      ├─ wait until every engine said hello, then serve HTTP and print the URL
      └─ SIGINT/SIGTERM: stop HTTP, tell engines to shut down, wait, then terminate stragglers

Engines watch our pid too: if this process is killed outright, they exit on their own.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import subprocess
import sys

from splitserve.frontend.engine_proc import add_engine_arguments

log = logging.getLogger("splitserve.serve")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="HTTP address (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--instances", type=int, default=1, help="colocated engine processes (data parallel)")
    p.add_argument("--max-queued-requests", type=int, default=256,
                   help="per engine, beyond --max-num-seqs; more gets 429 with Retry-After")
    p.add_argument("--pin-cores", action="store_true",
                   help="pin engine i to its own --threads-per-instance cores")
    p.add_argument("--engine-address", default="tcp://127.0.0.1:0",
                   help="where engines connect (ZeroMQ endpoint; default: loopback, ephemeral port)")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for engines")
    p.add_argument("--log-level", default="info")


def check_args(args: argparse.Namespace) -> None:
    if args.instances < 1:
        raise ValueError(f"--instances must be >= 1, got {args.instances}")
    if args.max_queued_requests < 0:
        raise ValueError(f"--max-queued-requests must be >= 0, got {args.max_queued_requests}")
    if args.threads_per_instance is not None and args.threads_per_instance < 1:
        raise ValueError(f"--threads-per-instance must be >= 1, got {args.threads_per_instance}")


def core_sets(instances: int, threads: int) -> list[str]:
    cores = sorted(os.sched_getaffinity(0))
    if instances * threads > len(cores):
        raise ValueError(f"--pin-cores needs {instances} x {threads} cores but only {len(cores)} are "
                         f"available; lower --instances or --threads-per-instance, or drop --pin-cores")
    return [",".join(str(c) for c in cores[i * threads:(i + 1) * threads]) for i in range(instances)]


def engine_command(args: argparse.Namespace, engine_id: str, address: str, cpus: str | None) -> list[str]:
    cmd = [sys.executable, "-m", "splitserve.cli", "engine", "--connect", address, "--engine-id", engine_id,
           "--role", "colocated", "--parent-pid", str(os.getpid()), "--device", args.device,
           "--prefill-policy", args.prefill_policy, "--max-num-batched-tokens", str(args.max_num_batched_tokens),
           "--max-num-seqs", str(args.max_num_seqs), "--kv-cache-memory", str(args.kv_cache_memory),
           "--block-size", str(args.block_size), "--seed", str(args.seed)]
    if args.model:
        cmd += ["--model", args.model]
    if args.threads_per_instance:
        cmd += ["--threads-per-instance", str(args.threads_per_instance)]
    if cpus:
        cmd += ["--cpus", cpus]
    return cmd


def load_renderer(model: str | None):
    from splitserve.frontend.render import Renderer
    from splitserve.models.loader import load_tokenizer

    tokenizer, chat_template = load_tokenizer(model)
    return Renderer(tokenizer, chat_template)


def stop_engines(processes: list[subprocess.Popen], grace_s: float = 10.0) -> None:
    for proc in processes:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in processes:
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            log.warning("engine pid %d did not stop in %.0f s; killing it", proc.pid, grace_s)
            proc.kill()
            proc.wait()


async def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from splitserve.frontend.api_server import build_app
    from splitserve.frontend.engine_client import EngineClient
    from splitserve.frontend.metrics import FrontendMetrics
    from splitserve.frontend.router import Router

    cpus = core_sets(args.instances, args.threads_per_instance or 1) if args.pin_cores else [None] * args.instances
    metrics, router = FrontendMetrics(), Router()
    client = EngineClient(None, router, metrics, bind=args.engine_address,
                          max_queued_requests=args.max_queued_requests)
    engine_ids = [f"engine-{i}" for i in range(args.instances)]
    processes = []
    try:
        for engine_id, cores in zip(engine_ids, cpus):
            proc = subprocess.Popen(engine_command(args, engine_id, client.address, cores))
            processes.append(proc)
            client.attach_process(engine_id, proc)
        client.start()
        # The tokenizer loads here while the engines load the model in their processes.
        client.renderer = await asyncio.to_thread(load_renderer, args.model)
        await client.wait_ready(engine_ids, args.startup_timeout)
        app = build_app(client, client.renderer, metrics)
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                lifespan="off", access_log=False, timeout_graceful_shutdown=5)
        server = uvicorn.Server(config)

        async def announce() -> None:
            while not server.started:
                await asyncio.sleep(0.05)
            print(f"splitserve: serving {client.model_name!r} on http://{args.host}:{args.port}/v1 "
                  f"with {args.instances} engine(s)", flush=True)

        announcer = asyncio.create_task(announce())
        await server.serve()
        announcer.cancel()
    finally:
        await client.shutdown()
        await asyncio.to_thread(stop_engines, processes)
        log.warning("all engines stopped")
    return 0


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    check_args(args)

    def on_term(signum, frame):  # before uvicorn installs its own handlers: stop like Ctrl-C
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    try:
        return asyncio.run(serve(args))
    except KeyboardInterrupt:
        return 0
