"""A whole server in one test process: the frontend's EngineClient on the test's event loop and
each engine's EngineProcess on threads, over real ZeroMQ and KV sockets, on a tiny model.

Starting one costs well under a second (no process spawn, no HTTP), so tests can change roles,
kill instances and count every block. `kill(id)` stops an engine without a word to the frontend
(it notices the silence, as it would a SIGKILL of a hand-started engine).
"""
from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

from splitserve.config import CacheConfig, EngineConfig, SchedulerConfig
from splitserve.engine.core import EngineCore
from splitserve.engine.process import EngineProcess
from splitserve.api.engine_client import EngineClient
from splitserve.api.render import load_renderer
from splitserve.coordinator.metrics import FrontendMetrics
from splitserve.coordinator.router import Router
from splitserve.kv_transfer import KVTransferConfig
from splitserve.kv_transfer.shm_pool import SEGMENT_PREFIX, SHM_DIR
from splitserve.models.loader import load_model
from splitserve.sampling import SamplingParams


def shm_segments() -> set[str]:
    """The KV segments this process created (other processes on the box have their own)."""
    return {p.name for p in Path(SHM_DIR).glob(f"{SEGMENT_PREFIX}{os.getpid()}-*")}


def mapped_segments() -> list[str]:
    """The KV segments this process maps now (its own pools and any attached peer pool)."""
    with open("/proc/self/maps") as f:
        return [line.split()[-1] for line in f if SEGMENT_PREFIX in line]


class Cluster:
    def __init__(self, model_dir, roles: dict[str, str], *, transport: str = "shm", kv="2MiB", max_num_seqs=16,
                 heartbeat_timeout_s: float = 1.0, retry_on_engine_failure: int = 1, lease_s: float = 30.0,
                 orphan_grace_s: float = 10.0, bind: str = "tcp://127.0.0.1:0", link=None,
                 max_queued_requests: int = 256, max_num_batched_tokens: int = 64) -> None:
        self.model_dir, self.roles = str(model_dir), roles
        self.kv_config = KVTransferConfig(transport=transport, lease_s=lease_s)
        self.kv, self.max_num_seqs, self.max_num_batched_tokens = kv, max_num_seqs, max_num_batched_tokens
        self.link = link  # EngineLinkSecurity: needed when `bind` is not loopback
        self.client = EngineClient(load_renderer(self.model_dir), Router(), FrontendMetrics(), bind=bind, link=link,
                                   heartbeat_timeout_s=heartbeat_timeout_s,
                                   retry_on_engine_failure=retry_on_engine_failure, orphan_grace_s=orphan_grace_s,
                                   max_queued_requests=max_queued_requests)
        self.engines: dict[str, EngineProcess] = {}
        self.threads: dict[str, threading.Thread] = {}
        self._loaded = load_model(self.model_dir)

    def _config(self, engine_id: str, role: str) -> EngineConfig:
        return EngineConfig(model=self.model_dir, instance_id=engine_id, role=role, kv_transfer=self.kv_config,
                            cache=CacheConfig(kv_cache_memory=self.kv),
                            scheduler=SchedulerConfig(max_num_seqs=self.max_num_seqs,
                                                      max_num_batched_tokens=self.max_num_batched_tokens))

    def start_engine(self, engine_id: str, role: str) -> None:
        process = EngineProcess(EngineCore(self._config(engine_id, role), self._loaded), engine_id,
                                self.client.address, link=self.link)
        thread = threading.Thread(target=process.run, name=f"engine {engine_id}", daemon=True)
        self.engines[engine_id], self.threads[engine_id] = process, thread
        thread.start()

    async def __aenter__(self) -> Cluster:
        self.client.start()
        for engine_id, role in self.roles.items():
            self.start_engine(engine_id, role)
        await self.client.wait_ready(list(self.roles), 60)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.client.shutdown()
        for engine_id in list(self.engines):
            self.kill(engine_id)

    def kill(self, engine_id: str) -> None:
        self.engines[engine_id].stopping.set()
        self.threads[engine_id].join(timeout=10)

    async def generate(self, prompt: list[int], max_tokens: int, request_id: str = "r", stop=(),
                       abort_after: int | None = None, **params) -> dict:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **params)
        stream = self.client.submit(request_id, prompt, params, list(stop))
        tokens, last = [], None
        try:
            async for event in stream:
                tokens += event.token_ids
                last = event
                if abort_after is not None and len(tokens) >= abort_after:
                    break
        finally:
            stream.close()
        return {"tokens": tokens, "finish": last.finish_reason, "error": last.error, "event": last}

    async def wait_idle(self, timeout_s: float = 20.0) -> None:
        """Every live engine reports no request, block, lease or transfer, and the router and the
        dispatcher hold no request (engines report a few times a second after any change)."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            busy = [i for i, inst in self.client.instances.items() if inst.alive and not idle(inst.stats)]
            routed = any(load.requests for load in self.client.router.instances.values())
            if not busy and not routed and not self.client.dispatcher.requests:
                return
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"not idle: engines {busy}, router {routed}, "
                                     f"requests {list(self.client.dispatcher.requests)}")
            await asyncio.sleep(0.05)


def idle(s) -> bool:
    return (s is not None and s.num_waiting == 0 and s.num_running == 0 and s.num_free_blocks == s.num_blocks_total
            and (s.kv is None or (s.kv.num_held_blocks == 0 and s.kv.num_pending == 0 and s.kv.num_transferring == 0)))


def prompt_of(n: int, seed: int = 0, vocab: int = 300) -> list[int]:
    return [3 + (seed * 7919 + i * 104729) % (vocab - 3) for i in range(n)]
