"""Serve with engines on the bed's hosts: `splitserve serve --topology` in the root namespace,
`splitserve engine` hand-started inside each host, KV over tcp with its HMAC secret.

    with NetBed(("a", "b"), LinkSpec.parse("1gbit")) as bed:
        with serve_across(bed, {"prefill-0": ("prefill", "a"), "decode-0": ("decode", "b")},
                          model=None, engine_args=["--threads-per-instance", "1"]) as server:
            httpx.post(server.base_url + "/v1/completions", json=...)

This is what a person does on real machines (the topology names each instance's host; serve
prints the command to run there and waits for it), with the bed's namespaces as the machines.
The frontend binds its engine socket on the bridge address (the root namespace as the hosts see
it), so the engine link needs `--engine-secret-file` (CurveZMQ); each prefill instance serves its
KV on its host's address, so KV needs `--kv-secret-file` (HMAC). Both secrets are fresh per run.
The HTTP API stays on 127.0.0.1 of the root namespace.
"""
from __future__ import annotations

import contextlib
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

from splitserve.testbed.netbed import NetBed
from splitserve.testbed.netns import stop_session


@dataclass(slots=True)
class AcrossServer:
    base_url: str
    engine_address: str
    engines: dict[str, subprocess.Popen] = field(default_factory=dict)
    serve: subprocess.Popen | None = None
    secrets_dir: Path | None = None


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _write_secret(folder: Path, name: str) -> Path:
    path = folder / name
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    return path


def engine_command(engine_id: str, role: str, address: str, kv_host: str, model: str | None,
                   engine_secret: Path, kv_secret: Path, engine_args: list[str]) -> list[str]:
    """The hand-start command of one instance (topology.hand_start_command, filled in)."""
    cmd = [sys.executable, "-m", "splitserve.cli", "engine", "--role", role, "--engine-id", engine_id,
           "--connect", address, "--kv-transport", "tcp", "--kv-host", kv_host,
           "--kv-secret-file", str(kv_secret), "--engine-secret-file", str(engine_secret),
           "--parent-pid", str(os.getpid())]  # one host's pids are all ours: it exits if we die
    if model:
        cmd += ["--model", model]
    return cmd + list(engine_args)


def wait_http(base_url: str, procs: list[subprocess.Popen], log_path: Path | None, deadline_s: float) -> None:
    stop = time.monotonic() + deadline_s
    while time.monotonic() < stop:
        dead = [p for p in procs if p.poll() is not None]
        if dead:
            raise RuntimeError(f"{dead[0].args[:8]} exited with {dead[0].returncode} before serving:\n"
                               f"{_tail(log_path)}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(base_url + "/v1/models", timeout=1.0).status_code == 200:
                return
        time.sleep(0.1)
    raise TimeoutError(f"{base_url} not serving after {deadline_s:.0f} s:\n{_tail(log_path)}")


def _tail(path: Path | None, num_lines: int = 40) -> str:
    if path is None or not path.exists():
        return "(no log)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-num_lines:])


@contextlib.contextmanager
def serve_across(bed: NetBed, placement: dict[str, tuple[str, str]], model: str | None = None,
                 serve_args: list[str] | tuple = (), engine_args: list[str] | tuple = (),
                 log_path: Path | None = None, port: int | None = None, startup_timeout_s: float = 300.0,
                 preexec_fn=None):
    """Yield an AcrossServer once every instance joined; stop all of it on exit.
    `placement`: engine id -> (role, bed host). `engine_args`: flags every engine gets (threads,
    KV memory, token budget); `serve_args`: flags of the frontend only."""
    for engine_id, (role, host) in placement.items():
        bed.host(host)  # KeyError naming the hosts when it is not in the bed
    with tempfile.TemporaryDirectory(prefix="splitserve-across-") as tmp:
        folder = Path(tmp)
        engine_secret, kv_secret = _write_secret(folder, "engine.secret"), _write_secret(folder, "kv.secret")
        address = f"tcp://{bed.gateway}:{free_port(bed.gateway)}"
        topology = folder / "topology.yaml"
        topology.write_text(yaml.safe_dump({"engine_address": address, "instances": [
            {"id": engine_id, "role": role, "host": bed.hosts[host].address}
            for engine_id, (role, host) in placement.items()]}))
        http_port = port or free_port("127.0.0.1")
        log_path = log_path or folder / "serve.log"  # the frontend's and every engine's output
        log_path.parent.mkdir(parents=True, exist_ok=True)
        server = AcrossServer(f"http://127.0.0.1:{http_port}", address, secrets_dir=folder)
        with open(log_path, "ab") as log:
            server.serve = subprocess.Popen(
                [sys.executable, "-m", "splitserve.cli", "serve", "--topology", str(topology), "--port",
                 str(http_port), "--kv-transport", "tcp", "--engine-secret-file", str(engine_secret),
                 "--kv-secret-file", str(kv_secret), *(["--model", model] if model else []), *serve_args],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=preexec_fn)
            try:
                for engine_id, (role, host) in placement.items():
                    cmd = engine_command(engine_id, role, address, bed.hosts[host].address, model,
                                         engine_secret, kv_secret, list(engine_args))
                    server.engines[engine_id] = bed.popen(host, cmd, stdout=log, stderr=subprocess.STDOUT,
                                                          stdin=subprocess.DEVNULL, preexec_fn=preexec_fn)
                wait_http(server.base_url, [server.serve, *server.engines.values()], log_path, startup_timeout_s)
                yield server
            finally:
                # the frontend stays in our process group (a signal to us reaches it too) and
                # starts no process itself; the engines go with the bed's sessions
                if server.serve.poll() is None:
                    server.serve.terminate()
                    try:
                        server.serve.wait(10)
                    except subprocess.TimeoutExpired:
                        server.serve.kill()
                        server.serve.wait(5)
                for proc in server.engines.values():
                    stop_session(proc)
