"""The arrangement `serve` runs, kept in a state file so a restarted server comes back as it was.

    serve --state-file PATH
      start:   PATH exists, is for this model and names a usable arrangement
                 -> those instances (ids, roles) start instead of the command line's (logged)
               no file -> the command line's, silently
               unreadable, corrupt, another model, unusable -> a warning saying why, the command
                 line's, and the file kept beside as PATH.rejected (the next write replaces PATH)
      serving: every POLL_S the arrangement is read from the coordinator and written when it
               differs from the one on disk (temp file + os.replace: a reader sees the old file
               or the new one, never half of one)
      stop:    the watcher stops before the engines do: their exits are no change

"The arrangement" is every instance this process started (from the command line or the state,
`POST /admin/instances`, a rolling restart's replacement) that said hello and was not drained
(`DELETE /admin/instances/{id}`, or replaced by a restart), with its current role: after a live
change by the admin API, the mix controller or a survivor taking over a lost stage. An instance
that died stays in it (a crash of the whole host kills engines before `serve`: dropping the dead
would save a half arrangement), so a restarted `serve` starts it again. Hand-started engines and
a topology's remote instances are not in it: `serve` cannot start them.
"""
from __future__ import annotations

import asyncio
import logging
import os
import re
import tempfile
import time
from pathlib import Path

import msgspec

from splitserve.roles import DECODE_CAPABLE, PREFILL_CAPABLE, ROLES

log = logging.getLogger("splitserve.serve")

STATE_VERSION = 1
POLL_S = 0.25
ENGINE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


class SavedInstance(msgspec.Struct):
    id: str
    role: str


class SavedArrangement(msgspec.Struct):
    version: int
    model: str
    instances: list[SavedInstance]
    saved_at: str = ""  # UTC, for people; nothing reads it


class StateRejected(Exception):
    """The state file cannot be used; the message says why."""


def check_state_path(path: str) -> None:
    """At argument checking: a path whose folder is missing fails before any engine starts."""
    target = Path(path)
    if target.is_dir():
        raise ValueError(f"--state-file {path} is a directory; name a file in it")
    if not target.parent.is_dir():
        raise ValueError(f"--state-file {path}: the folder {target.parent} does not exist; create it first")


def model_key(model: str) -> str:
    """What 'the same model' means: a local checkpoint by its real path (relative or absolute,
    symlinked or not), anything else (a hub name) as given."""
    return os.path.realpath(model) if os.path.exists(model) else model


def read_arrangement(path: str, model: str) -> list[tuple[str, str]] | None:
    """(id, role) of each saved instance; None when there is no file; StateRejected otherwise."""
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise StateRejected(f"cannot read it ({e.strerror})") from None
    try:
        saved = msgspec.json.decode(raw, type=SavedArrangement)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise StateRejected(f"it is not a splitserve state file ({e})") from None
    if saved.version != STATE_VERSION:
        raise StateRejected(f"it has version {saved.version}; this splitserve reads version {STATE_VERSION}")
    if saved.model != model_key(model):
        raise StateRejected(f"it is for the model {saved.model!r}, this server runs {model_key(model)!r}")
    roles = [(i.id, i.role) for i in saved.instances]
    if why := check_arrangement(roles):
        raise StateRejected(why)
    return roles


def check_arrangement(roles: list[tuple[str, str]]) -> str | None:
    if not roles:
        return "it names no instance"
    for engine_id, role in roles:
        if not ENGINE_ID.fullmatch(engine_id):
            return f"instance id {engine_id!r} is not a usable engine id"
        if role not in ROLES:
            return f"instance {engine_id} has the role {role!r}, not one of {', '.join(ROLES)}"
    ids = [i for i, _ in roles]
    if len(set(ids)) != len(ids):
        return f"it names an instance twice ({', '.join(ids)})"
    if not any(r in PREFILL_CAPABLE for _, r in roles) or not any(r in DECODE_CAPABLE for _, r in roles):
        return "no instance in it could prefill, or none could decode"
    return None


def restore_arrangement(path: str, model: str, command_line: list[tuple[str, str]],
                        reserved: set[str], kv_port: int = 0) -> list[tuple[str, str]]:
    """The instances `serve` starts: the saved ones if the file is usable, else `command_line`.
    reserved: ids taken by instances serve does not start (a topology's remote ones)."""
    said = ", ".join(f"{i} ({r})" for i, r in command_line) or "none"
    try:
        roles = read_arrangement(path, model)
        if roles is None:
            return command_line
        if clash := sorted(reserved & {i for i, _ in roles}):
            raise StateRejected(f"its instance ids {clash} are the topology's remote instances")
        if kv_port != 0 and sum(r == "prefill" for _, r in roles) > 1:
            raise StateRejected(f"it has several prefill instances, which cannot share --kv-port {kv_port}")
    except StateRejected as e:
        aside = f"{path}.rejected"
        try:
            os.replace(path, aside)
            kept = f"it is kept as {aside}"
        except OSError as moved:
            kept = f"it could not be moved aside ({moved.strerror}) and will be overwritten"
        log.warning("the state file %s is not used: %s; starting as the command line says (%s); %s",
                    path, e, said, kept)
        return command_line
    log.warning("restoring the arrangement saved in %s: %s (the command line said %s; delete the file to "
                "start as the command line says)", path, ", ".join(f"{i} ({r})" for i, r in roles), said)
    return roles


def write_arrangement(path: str, model: str, roles: list[tuple[str, str]]) -> None:
    """Atomically: the file is always a whole state, old or new."""
    saved = SavedArrangement(STATE_VERSION, model_key(model), [SavedInstance(i, r) for i, r in roles],
                             time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(msgspec.json.format(msgspec.json.encode(saved)) + b"\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


class ArrangementWatcher:
    """Writes the arrangement whenever it changed (see the module docstring). `owned` holds the
    ids this process started, in the order it started them; serve adds each one it starts. No
    file is written while one of them has not yet said hello: a restart then would bring back
    part of the arrangement. The rows keep serve's start order, not the order of the hellos."""

    def __init__(self, client, path: str, model: str, owned: dict[str, None]) -> None:
        self.client, self.path, self.model, self.owned = client, path, model, owned
        self._seen: set[str] = set()   # owned ids that said hello at least once
        self._written: list[tuple[str, str]] | None = None
        self._failing: str | None = None
        self._task: asyncio.Task | None = None

    def arrangement(self) -> list[tuple[str, str]] | None:
        """The owned instances serving now, or None while one of them has not said hello yet."""
        rows = []
        for engine_id in list(self.owned):
            inst = self.client.instances.get(engine_id)
            if inst is None:
                if engine_id not in self._seen:
                    return None
                continue
            self._seen.add(engine_id)
            load = self.client.router.instances.get(engine_id)
            if not inst.removed and not (load is not None and load.draining):
                rows.append((engine_id, inst.hello.role))
        return rows

    def save_if_changed(self) -> None:
        now = self.arrangement()
        if now == self._written or not now:
            return
        if check_arrangement(now) is not None:
            # e.g. the only decode instance gone and no survivor yet: a restart could not start this,
            # so the last arrangement that could be restored stays in the file until one can again
            return
        try:
            write_arrangement(self.path, self.model, now)
        except OSError as e:
            why = e.strerror or str(e)  # not str(e): it names the temp file, new at every try
            if why != self._failing:  # once per distinct error, not four times a second
                log.error("cannot write the state file %s (%s); serving goes on, the arrangement is not saved",
                          self.path, why)
            self._failing = why
            return
        self._written, self._failing = now, None
        log.info("state file %s: %s", self.path, ", ".join(f"{i} ({r})" for i, r in now))

    async def _run(self) -> None:
        while True:
            self.save_if_changed()
            await asyncio.sleep(POLL_S)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
