"""How many engines `POST /admin/instances` (and a restart's replacement) may start: a count cap and the memory they need.

Each engine holds the model weights and its whole KV cache, so one call could otherwise
start engines until the machine swaps or the OOM killer picks a victim. Before spawning:

    alive or starting instances >= --max-instances                   -> 409, and the cap
    (starting + 1) x largest RSS of our local engines > MemAvailable  -> 503, and the numbers

The projection uses the resident size of engines already running here (the new one loads
the same model with the same cache), so it needs no model-specific arithmetic; with no local
engine to measure only the count applies.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from splitserve.api.openai_schema import ApiError

SpawnEngine = Callable[[str, str | None], str]  # (role, an id or None: one is made up) -> the new engine's id
MEMINFO = Path("/proc/meminfo")


def _kib_field(path: Path, name: str) -> int | None:
    try:
        for line in path.read_text().splitlines():
            if line.startswith(name + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def rss_bytes(pid: int, proc: Path = Path("/proc")) -> int | None:
    """The resident size of a local splitserve engine; None for any other pid (a remote engine's
    pid may name an unrelated process here)."""
    try:
        if b"splitserve" not in (proc / str(pid) / "cmdline").read_bytes():
            return None
    except OSError:
        return None
    return _kib_field(proc / str(pid) / "status", "VmRSS")


def available_bytes(meminfo: Path = MEMINFO) -> int | None:
    return _kib_field(meminfo, "MemAvailable")


class InstanceBudget:
    """Wraps the launcher's spawn function with the two checks; `client` is the EngineClient."""

    def __init__(self, spawn: SpawnEngine, client, max_instances: int,
                 rss: Callable[[int], int | None] = rss_bytes,
                 available: Callable[[], int | None] = available_bytes, startup_timeout_s: float = 600.0) -> None:
        self._spawn, self._client, self.max_instances = spawn, client, max_instances
        self._rss, self._available, self.startup_timeout_s = rss, available, startup_timeout_s
        self._starting: dict[str, float] = {}  # spawned, no hello yet -> when

    def _num_starting(self) -> int:
        # One that never says hello (died loading) stops counting after the startup timeout.
        now = time.monotonic()
        self._starting = {i: t for i, t in self._starting.items()
                          if i not in self._client.instances and now - t < self.startup_timeout_s}
        return len(self._starting)

    def _local_engine_rss(self) -> int | None:
        sizes = [size for inst in self._client.live_instances() if inst.hello.pid
                 and (size := self._rss(inst.hello.pid))]
        return max(sizes) if sizes else None

    def check(self) -> None:
        starting = self._num_starting()
        alive = len(self._client.live_instances())
        if alive + starting >= self.max_instances:
            raise ApiError(409, f"{alive} instance(s) alive and {starting} starting reach the cap of "
                                f"{self.max_instances}; drain one first (DELETE /admin/instances/ID) or start "
                                "the server with a larger --max-instances", code="too_many_instances")
        per_engine, free = self._local_engine_rss(), self._available()
        if per_engine is not None and free is not None and (starting + 1) * per_engine > free:
            raise ApiError(503, f"another engine would need about {per_engine >> 20} MiB (the size of those "
                                f"running here) on top of {starting} starting, but only {free >> 20} MiB are "
                                "available; free memory or lower --kv-cache-memory", "server_error",
                           code="insufficient_memory")

    def __call__(self, role: str, engine_id: str | None = None) -> str:
        self.check()
        engine_id = self._spawn(role, engine_id)
        self._starting[engine_id] = time.monotonic()
        return engine_id
