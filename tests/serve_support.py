"""Start a real `splitserve serve` (frontend + engine processes) on a free loopback port."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A `splitserve serve` child on a free loopback port. The port is picked before the server binds
    it, so another process can take it in between (CI once lost a test so: the other pytest worker's
    servers bind ephemeral ports all the time); wait_ready then starts it again on another port."""

    PORT_RACE_TRIES = 3

    def __init__(self, model: str | None, *extra: str, instances: int = 1, log_path: Path | None = None) -> None:
        self.model, self.extra, self.instances = model, extra, instances
        self._own_log = log_path is None  # a temporary file, removed by stop()
        if log_path is None:
            fd, name = tempfile.mkstemp(prefix="splitserve-serve-", suffix=".log")
            os.close(fd)
            log_path = Path(name)
        self.log_path = log_path
        self.launch()

    def command(self, port: int) -> list[str]:
        cmd = [sys.executable, "-m", "splitserve.cli", "serve", "--port", str(port),
               "--instances", str(self.instances), "--threads-per-instance", "1", "--log-level", "warning",
               *self.extra]
        if self.model:
            cmd += ["--model", self.model]
        return cmd

    def launch(self) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self._log = open(self.log_path, "wb")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(self.command(self.port), cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=env)

    def text(self) -> str:
        """The whole log, for what a test looks for in it (a line from startup, or one followed by
        many others on a busy box, is not in the tail)."""
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:  # a temporary log after stop()
            return ""

    def log(self) -> str:
        """The log's last 4,000 characters, for a failed assertion's message."""
        return self.text()[-4000:]

    def wait_ready(self, timeout_s: float = 180.0) -> ServerProcess:
        deadline = time.monotonic() + timeout_s
        tries = 1
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._log.close()
                if port_was_taken(self.text()) and tries < self.PORT_RACE_TRIES:
                    tries += 1
                    self.launch()
                    continue
                raise RuntimeError(f"server exited with {self.proc.returncode} during startup:\n{self.log()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"server not ready after {timeout_s} s:\n{self.log()}")

    def health(self) -> dict:
        return httpx.get(self.base_url + "/health", timeout=5).json()

    def stop(self, timeout_s: float = 30.0) -> int:
        stop_process(self.proc, timeout_s)
        self._log.close()
        if self._own_log:
            self.log_path.unlink(missing_ok=True)
        return self.proc.returncode


def port_was_taken(log: str) -> bool:
    """The server's log says its HTTP port was taken before it could listen there."""
    return "cannot listen on" in log and "Address already in use" in log


def stop_process(proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """SIGTERM, then SIGKILL if it has not exited within timeout_s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def secret_flags(folder: Path) -> list[str]:
    """--engine-secret-file and --kv-secret-file for a server that engines started by hand join:
    without them `serve` secures its links with secrets it generates, which such an engine cannot know."""
    flags = []
    for what in ("engine", "kv"):
        path = folder / f"{what}.secret"
        path.write_text(os.urandom(32).hex())
        flags += [f"--{what}-secret-file", str(path)]
    return flags


def metric_samples(base_url: str, name: str) -> dict[str, float]:
    """{label-string: value} of one metric, from the server's /metrics text."""
    out = {}
    for line in httpx.get(base_url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            key, _, value = line.rpartition(" ")
            out[key[len(name):]] = float(value)
    return out


def wait_until(predicate, timeout_s: float = 15.0, interval_s: float = 0.1) -> bool:
    """Polls until the predicate holds (engines report stats a few times a second)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


def all_blocks_free(base_url: str) -> bool:
    """Every engine reports zero KV blocks in use, and the router holds no request."""
    outstanding = metric_samples(base_url, "splitserve_instance_outstanding_tokens")
    if any(v != 0 for v in outstanding.values()):
        return False
    used = metric_samples(base_url, "splitserve_instance_kv_blocks_used")
    free = metric_samples(base_url, "splitserve_instance_kv_blocks_free")
    return bool(used) and all(v == 0 for v in used.values()) and all(v > 0 for v in free.values())


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by a dying parent) counts as gone.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False
