"""Start one arrangement's server, wait until it answers, and always tear it down.

An arrangement is data (spec.Arrangement): `splitserve serve` arguments, any server command
with a `{port}` placeholder, or the URL of an endpoint someone else runs. Launched servers
get a free loopback port, their own process group and a log file in the output folder.
"""
from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx

from splitserve.trial.network import launched_across
from splitserve.trial.spec import Arrangement


class LaunchError(RuntimeError):
    """The arrangement's server died or never became ready; the message quotes its log."""


@dataclass(slots=True)
class Endpoint:
    base_url: str
    model: str | None  # the id /v1/models reports, sent with every request
    pid: int | None = None  # the launched server's process (None for an external URL)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The port is picked before the server binds it, so another process may take it in between; a server
# that exits saying so is started again on another port, this many launches in all.
PORT_RACE_TRIES = 3


def port_was_taken(log_path: pathlib.Path) -> bool:
    """The launched server's log says its port was in use (`serve`, uvicorn and most servers print
    the OS's words for EADDRINUSE)."""
    return "address already in use" in _tail(log_path).lower()


def server_command(arr: Arrangement, port: int, model: str | None) -> list[str]:
    if arr.command is not None:
        return [part.replace("{port}", str(port)) for part in arr.command]
    model_args = ["--model", model] if model else []
    return [sys.executable, "-m", "splitserve.cli", "serve", "--port", str(port),
            *model_args, *arr.serve_args]


def wait_ready(base_url: str, deadline_s: float, proc: subprocess.Popen | None = None,
               log_path: pathlib.Path | None = None) -> str | None:
    """Poll /v1/models until it answers; return the first model id (None if it lists none)."""
    stop = time.monotonic() + deadline_s
    while time.monotonic() < stop:
        if proc is not None and proc.poll() is not None:
            raise LaunchError(f"server exited with code {proc.returncode} before it was ready:\n"
                              f"{_tail(log_path)}")
        try:
            resp = httpx.get(f"{base_url}/v1/models", timeout=2.0)
            if resp.status_code == 200:
                data = resp.json().get("data") or []
                return data[0].get("id") if data else None
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.25)
    raise LaunchError(f"{base_url} was not ready within {deadline_s:.0f}s:\n{_tail(log_path)}")


def _tail(path: pathlib.Path | None, num_lines: int = 30) -> str:
    if path is None or not path.exists():
        return "(no log)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-num_lines:])


@contextlib.contextmanager
def launched(arr: Arrangement, model: str | None, log_dir: pathlib.Path, startup_timeout_s: float = 300.0,
             cpus: list[int] | None = None):
    """Yield a ready Endpoint for the arrangement; stop the server (if we started it) on exit.
    `cpus`: pin the server before it starts, so every process it spawns (its engines) inherits them."""
    if arr.url is not None:
        base_url = arr.url.rstrip("/")
        yield Endpoint(base_url, wait_ready(base_url, 30.0))
        return
    log_dir.mkdir(parents=True, exist_ok=True)
    if arr.network is not None:  # engines on the hosts of a bed, over its shaped links
        with launched_across(arr.network, arr.serve_args, model, log_dir / f"{arr.name}.log",
                             startup_timeout_s, cpus) as (base_url, pid):
            yield Endpoint(base_url, wait_ready(base_url, 30.0), pid)
        return
    for attempt in range(1, PORT_RACE_TRIES + 1):
        port = free_port()
        log_path = log_dir / f"{arr.name}.log"
        if log_path.exists():  # a repeat, or a relaunch: keep every launch's log
            log_path = log_dir / f"{arr.name}.{len(list(log_dir.glob(arr.name + '.*log')))}.log"
        with open(log_path, "wb") as log:
            pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
            proc = subprocess.Popen(server_command(arr, port, model), stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=pin)
        base_url = f"http://127.0.0.1:{port}"
        try:
            model_id = wait_ready(base_url, startup_timeout_s, proc, log_path)
        except BaseException as exc:  # Ctrl-C too: nothing launched outlives the trial
            stop_process_group(proc)
            if (isinstance(exc, LaunchError) and attempt < PORT_RACE_TRIES and proc.poll() is not None
                    and port_was_taken(log_path)):
                continue
            raise
        break
    try:
        yield Endpoint(base_url, model_id, proc.pid)
    finally:
        stop_process_group(proc)


def stop_process_group(proc: subprocess.Popen, grace_s: float = 10.0, whole_group: bool = False) -> None:
    """SIGTERM the server's own process group (its engines too), then SIGKILL what remains.
    whole_group: signal the group even when its leader has already exited, and wait until every
    process in it is gone, not only the leader (the profile's busy neighbours: nothing of them may
    outlive the steps they were started for)."""
    if proc.poll() is not None and not whole_group:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    if not whole_group:
        try:
            proc.wait(grace_s)
            return
        except subprocess.TimeoutExpired:
            pass
    else:
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            proc.poll()  # reap the leader, so a finished group reads as gone
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                proc.wait()
                return
            time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(5.0)
