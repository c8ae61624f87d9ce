"""A Cluster whose engines live on the bed's hosts: each engine is a thread moved into its host's
network namespace (Host.enter) before it opens a socket, so the frontend (the test's loop, in the
root namespace) reaches it through the bridge and KV crosses the shaped veth links over tcp, with
both secrets on (off loopback they are required). Threads instead of processes keep a test within
a few seconds: one model load, no interpreter start. `splitserve.testbed.across.serve_across`
runs the same arrangement as real processes (bench/hosts.py).
"""
from __future__ import annotations

import dataclasses
import secrets
import threading

import pytest

from cluster_support import Cluster
from splitserve.engine.core import EngineCore
from splitserve.engine.process import EngineProcess
from splitserve.link_security import EngineLinkSecurity
from splitserve.testbed.netbed import NetBed, unavailable_reason

REASON = unavailable_reason()
needs_netns = pytest.mark.skipif(REASON is not None, reason=f"no network namespaces here: {REASON}")


class BedCluster(Cluster):
    def __init__(self, model_dir, bed: NetBed, placement: dict[str, tuple[str, str]], send_mode: str = "end",
                 decode_fault_rate: float = 0.0, **kwargs) -> None:
        self.bed, self.placement = bed, placement  # engine id -> (role, bed host)
        self.send_mode = send_mode  # kv send mode: end | overlap
        self.decode_fault_rate = decode_fault_rate  # transfers the decode instances fail on purpose
        self.kv_secret = secrets.token_hex(16).encode()
        super().__init__(model_dir, {i: role for i, (role, _) in placement.items()}, transport="tcp",
                         bind=f"tcp://{bed.gateway}:0", link=EngineLinkSecurity(secrets.token_hex(32).encode()),
                         **kwargs)

    def _config(self, engine_id: str, role: str):
        """Each engine serves its KV on its own host's address, which needs the secret."""
        config = super()._config(engine_id, role)
        host = self.bed.hosts[self.placement[engine_id][1]]
        config.kv_transfer = dataclasses.replace(
            self.kv_config, host=host.address, secret=self.kv_secret, send_mode=self.send_mode,
            fault_rate=self.decode_fault_rate if role == "decode" else 0.0)
        return config

    def start_engine(self, engine_id: str, role: str) -> None:
        host = self.bed.hosts[self.placement[engine_id][1]]
        created = threading.Event()

        def run() -> None:
            host.enter()  # every socket and thread this engine makes from here on is on `host`
            try:
                process = EngineProcess(EngineCore(self._config(engine_id, role), self._loaded), engine_id,
                                        self.client.address, link=self.link)
                self.engines[engine_id] = process
            finally:
                created.set()
            process.run()

        thread = threading.Thread(target=run, name=f"engine {engine_id} on {host.name}", daemon=True)
        self.threads[engine_id] = thread
        thread.start()
        created.wait(60)
