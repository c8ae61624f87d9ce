"""Restarting the coordinator (`serve` itself) without restarting its engines.

    POST /admin/coordinator/restart   (splitserve admin restart-coordinator)
      old process: refuse new requests (503 coordinator_restarting, Retry-After), end every request
                   in flight with a clear error (counted) and tell its engines to drop it, answer 202,
                   stop HTTP; keep the listening socket open (a dup, so connections made meanwhile wait
                   in its backlog), close the engine link WITHOUT telling the engines to stop, then
                   os.execv(the same python, `-m splitserve.cli`, the same argv): the same pid, so the
                   engines (our children, watching our pid) keep running with their model loaded
      new process: reads the handover (a memfd named in SPLITSERVE_HANDOVER_FD: the engine address,
                   the link and KV secrets, the engines it adopts, the HTTP socket), binds the same
                   engine address with the same secrets, adopts the engine processes by pid, loads the
                   tokenizer and waits until every adopted engine said hello again (engine_link asks an
                   engine that speaks without a hello for one; the engine drops whatever it still held
                   for the old process, freeing its blocks), then serves on the inherited socket.

What is kept and what is not is in docs/reliability.md ("Coordinator restart"). The new process
runs the code now on disk: this is how the frontend is updated; the engines keep theirs (their hello
must still speak the same protocol version). Refused (409): under Ray (its actors belong to this
driver), while an instance is starting, draining, changing its role or being restarted, or while
another coordinator restart is under way.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time

import msgspec

from splitserve.coordinator.rolling_restart import RestartRefused

log = logging.getLogger("splitserve.serve")

HANDOVER_ENV = "SPLITSERVE_HANDOVER_FD"
STOP_SERVING_AFTER_S = 0.2  # lets the 202 and the failed streams' last chunks leave first
REFUSAL = "the coordinator (serve) is restarting; its engines keep running: retry in a few seconds"
FAILURE = ("the coordinator (serve) restarted while this request was in flight: the request was ended "
           "and its engine told to drop it; send it again")


class AdoptedEngine(msgspec.Struct, frozen=True):
    id: str
    role: str
    pid: int


class Handover(msgspec.Struct, frozen=True):
    engine_address: str
    engines: list[AdoptedEngine]
    http_fd: int | None = None
    link_secret: bytes | None = None
    kv_secret: bytes | None = None
    generated_secrets: bool = False
    restarts: int = 1                # coordinator restarts of this serve so far, this one included
    failed_requests: int = 0         # requests ended by them, all of them together
    requested_at: float = 0.0        # time.time() when the old process was asked


class AdoptedProcess:
    """An engine process started by this pid before it re-executed itself. No Popen survives
    exec; the child does (still ours: waitpid works). What engine_link, stop_processes and
    rolling_restart.wait_exit ask of a Popen."""

    def __init__(self, pid: int) -> None:
        self.pid, self.returncode = pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # not our child (any more): gone as far as we can tell
                self.returncode = -1
            else:
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.05)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def take_handover() -> Handover | None:
    """The handover the previous process left us, or None at a normal start. The variable is
    removed, so the engines and API processes we start do not see it."""
    value = os.environ.pop(HANDOVER_ENV, None)
    if value is None:
        return None
    fd = int(value)
    with os.fdopen(fd, "rb") as f:
        return msgspec.msgpack.decode(f.read(), type=Handover)


def exec_with_handover(handover: Handover) -> None:
    """Replace this process by a fresh `serve` with the same argv; never returns."""
    fd = os.memfd_create("splitserve-handover")  # not a file anyone else can open; gone with us
    os.write(fd, msgspec.msgpack.encode(handover))
    os.lseek(fd, 0, os.SEEK_SET)
    os.set_inheritable(fd, True)
    if handover.http_fd is not None:
        os.set_inheritable(handover.http_fd, True)
    os.environ[HANDOVER_ENV] = str(fd)
    argv = [sys.executable, "-m", "splitserve.cli", *sys.argv[1:]]
    log.warning("coordinator restart: re-executing %s with %d engines kept", " ".join(argv[:4]),
                len(handover.engines))
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os.execv(sys.executable, argv)


class CoordinatorRestart:
    """The admin route's half: decide, end what runs, and ask uvicorn to stop; serve() then calls
    exec_with_handover with `handover`."""

    def __init__(self, client, args, refused: str | None = None) -> None:
        self.client, self.args, self.refused = client, args, refused
        self.handover: Handover | None = None
        self.stop_serving = None        # set by serve() once uvicorn exists
        self.stop_accepting = lambda: None  # closes uvicorn's listeners (the kept duplicate goes on queueing)
        self.http_fd: int | None = None  # the listening socket of API process 0 (this one)
        self.previous: Handover | None = None  # the handover this process started from, if any
        self.busy = lambda: None        # -> why not now (a rolling restart under way), or None

    def check(self) -> None:
        if self.refused is not None:
            raise RestartRefused(409, self.refused)
        if self.handover is not None or self.stop_serving is None:
            raise RestartRefused(409, "a coordinator restart is already under way (or the server is not serving yet)")
        why = self.busy()
        if why is not None:
            raise RestartRefused(409, why)
        link = self.client.link
        for engine_id, proc in link._processes.items():
            if engine_id not in self.client.instances and proc.poll() is None:
                raise RestartRefused(409, f"engine instance {engine_id!r} is still starting; restart the "
                                          "coordinator once it serves (GET /admin/instances)")
        for engine_id, load in self.client.router.instances.items():
            if load.draining or load.changing_role:
                raise RestartRefused(409, f"engine instance {engine_id!r} is draining or changing its role; "
                                          "restart the coordinator once that is done")

    def kept_engines(self) -> list[AdoptedEngine]:
        """Alive engines this process started (a Popen or an adopted pid), not removed, in the
        order it started them (the state file keeps that order, not the hellos')."""
        kept = []
        started = list(self.client.link._processes)
        for engine_id, inst in sorted(self.client.instances.items(),
                                      key=lambda kv: started.index(kv[0]) if kv[0] in started else len(started)):
            proc = inst.process
            if inst.alive and not inst.removed and proc is not None and proc.poll() is None:
                kept.append(AdoptedEngine(engine_id, inst.hello.role, proc.pid))
        return kept

    def request(self) -> dict:
        """-> the 202 body. Raises RestartRefused."""
        self.check()
        args, http_fd = self.args, self.http_fd
        kept = self.kept_engines()
        failed = self.client.dispatcher.stop_taking(REFUSAL, FAILURE)
        before = self.previous
        self.handover = Handover(
            engine_address=self.client.address, engines=kept,
            http_fd=os.dup(http_fd) if http_fd is not None else None,  # uvicorn closes its own copy
            link_secret=args.engine_link_secret, kv_secret=getattr(args, "kv_secret", None),
            generated_secrets=bool(args.generated_secrets),
            restarts=(before.restarts if before else 0) + 1,
            failed_requests=(before.failed_requests if before else 0) + failed, requested_at=time.time())
        log.warning("coordinator restart requested: %d requests in flight ended, keeping engines %s", failed,
                    ", ".join(f"{e.id} ({e.role}, pid {e.pid})" for e in kept) or "(none)")
        # from now on a new connection waits in the kept socket's backlog for the new process, and
        # every answer here closes its connection, so a client's next request goes there too
        self.stop_accepting()
        asyncio.get_running_loop().call_later(STOP_SERVING_AFTER_S, self.stop_serving)
        return {"status": "restarting", "failed_requests": failed, "restart": self.handover.restarts,
                "engines": [{"id": e.id, "role": e.role, "pid": e.pid} for e in kept]}


class CloseWhileRestarting:
    """ASGI: once a coordinator restart was asked, every answer says `Connection: close`, so a
    client does not send its next request on a kept-alive connection to the process that stops."""

    def __init__(self, app, restart: CoordinatorRestart) -> None:
        self.app, self.restart = app, restart

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_closing(message) -> None:
            if message["type"] == "http.response.start" and self.restart.handover is not None:
                message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        await self.app(scope, receive, send_closing)
