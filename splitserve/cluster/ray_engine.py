"""One engine instance under Ray: a Ray actor whose only job is to run `splitserve engine` as its child.

    Ray (placement, restarts)
      └─ EngineActor (num_cpus = the engine's threads, on a node that has the role's resource)
           └─ `splitserve engine --connect <frontend> --parent-pid <actor> --config-stdin`
                ZeroMQ + msgspec to the frontend, KV over the project's TCP transport, as ever

The actor runs the same engine process a local `serve` starts, so the engine code does not know
Ray exists: one engine path to test, and Ray never carries tokens or KV. The actor lives exactly
as long as its engine:
- the engine exits with 0 (drained, told to shut down, SIGTERM): the actor ends for good;
- any other exit (a crash, SIGKILL, the OOM killer): the actor exits with it and Ray restarts it
  (`max_restarts`), which starts a fresh engine under the same id;
- the actor dies (its node is lost, Ray kills it): the engine sees its parent gone and exits.

A restarted engine says hello under the id of the one that died. The frontend refuses a second
hello for an id it still thinks alive, so a restarted actor first waits out the frontend's
silence timeout: by then the dead engine has been declared dead and its requests moved.
This module imports Ray lazily; `ray_placement.py` turns the class into a Ray actor.
"""
from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
import warnings

from splitserve.protocol import decode_engine_config, encode_engine_config

log = logging.getLogger("splitserve.ray")


class EngineActor:
    def __init__(self, connect: str, config: bytes, engine_secret: bytes | None, env: dict[str, str],
                 kv_host_is_node: bool, restart_delay_s: float) -> None:
        import ray

        with warnings.catch_warnings():  # Ray's property warns about an API it uses itself
            warnings.simplefilter("ignore", DeprecationWarning)
            reconstructed = ray.get_runtime_context().was_current_actor_reconstructed
        if reconstructed:
            time.sleep(restart_delay_s)
        engine_config = decode_engine_config(config)
        if kv_host_is_node:  # decode instances on other nodes dial this node's address for the KV
            engine_config.kv_transfer.host = ray.util.get_node_ip_address()
        cmd = [sys.executable, "-m", "splitserve.cli", "engine", "--connect", connect, "--parent-pid",
               str(os.getpid()), "--config-stdin"]
        self._secret_path = None
        if engine_secret is not None:  # the serve host's secret file is not on this node: write our own
            fd, self._secret_path = tempfile.mkstemp(prefix="splitserve-engine-secret-")
            with os.fdopen(fd, "wb") as f:  # mkstemp: mode 0600
                f.write(engine_secret)
            cmd += ["--engine-secret-file", self._secret_path]
        self.proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdin=subprocess.PIPE)
        try:
            self.proc.stdin.write(encode_engine_config(engine_config))  # the KV secret stays out of `ps`
            self.proc.stdin.close()
        except BrokenPipeError:
            pass  # it died at once: the watcher restarts us
        threading.Thread(target=self._watch, name="engine-watch", daemon=True).start()

    def _watch(self) -> None:
        code = self.proc.wait()
        if self._secret_path is not None:
            with contextlib.suppress(OSError):  # whatever happens here, the exit below must follow
                os.unlink(self._secret_path)
        if code == 0:  # it was told to stop: no restart
            import ray

            ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
            return
        log.error("engine pid %d exited with code %d; its actor exits so that Ray restarts both",
                  self.proc.pid, code)
        os._exit(1)

    def engine_pid(self) -> int:
        return self.proc.pid

    def wait(self, timeout_s: float) -> int | None:
        """The engine's exit code once it has exited, or None after timeout_s."""
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None
