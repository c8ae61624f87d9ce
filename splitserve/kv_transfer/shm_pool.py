"""A KV pool that lives in POSIX shared memory, so a decode instance on the same
host can read a prefill instance's blocks without a socket in the way.

The prefill instance allocates its whole pool here (`allocate_kv_pool`) instead of
with torch.zeros; a decode instance attaches by name (`attach_kv_pool`, read-only
mapping) and copies the blocks it needs once. Segments are files in /dev/shm named
`splitserve-kv-<owner pid>-<instance>-<random>`: the owner unlinks on close and at
interpreter exit, and `cleanup_stale_segments` removes those whose owner died without doing
so (a prefill instance on start, a decode instance when it notices a source died).

The random part makes a name unguessable, so another local user cannot pre-create it to
block start-up (creation is O_EXCL, mode 0600, and never follows a symlink); attaching
checks the name's form and that the segment belongs to our own user.
"""
from __future__ import annotations

import math
import mmap
import os
import re
import secrets
import warnings
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch

SHM_DIR = Path("/dev/shm")
SEGMENT_PREFIX = "splitserve-kv-"
_STALE_RE = re.compile(rf"^{re.escape(SEGMENT_PREFIX)}(\d+)-")
_NAME_RE = re.compile(rf"^{re.escape(SEGMENT_PREFIX)}\d+-[A-Za-z0-9_.-]{{1,200}}$")


def segment_name(instance_id: str) -> str:
    """A fresh unguessable name that still tells `cleanup_stale_segments` who owns it."""
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", instance_id):
        raise ValueError(f"instance id {instance_id!r} cannot name a shared-memory segment; "
                         "use letters, digits, '.', '_' and '-'")
    return f"{SEGMENT_PREFIX}{os.getpid()}-{instance_id}-{secrets.token_hex(8)}"


def segment_owner(name: str) -> int | None:
    """The owner pid a segment name carries; None for a name that is not ours."""
    match = _STALE_RE.match(name) if _NAME_RE.match(name) else None
    return int(match.group(1)) if match else None


def owner_alive(name: str) -> bool:
    pid = segment_owner(name)
    return pid is not None and _pid_alive(pid)


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown torch dtype {name!r}; expected e.g. 'float32', 'bfloat16'")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _unlink_quietly(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


@dataclass(eq=False)
class KVPoolHandle:
    """Keeps a mapping alive; the owner's handle removes the segment when closed."""

    name: str
    path: Path
    num_bytes: int
    owner: bool
    _mmap: mmap.mmap
    _finalizer: weakref.finalize | None = field(default=None, repr=False)

    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # unlinks once; the file stays mapped until the tensor goes
        try:
            self._mmap.close()
        except BufferError:
            pass  # a tensor still views the mapping; the kernel unmaps it when that tensor dies


def _check_shape(shape: tuple[int, ...]) -> int:
    if len(shape) == 0 or any(int(s) <= 0 for s in shape):
        raise ValueError(f"kv pool shape must be positive sizes, got {tuple(shape)}")
    return math.prod(int(s) for s in shape)


def allocate_kv_pool(shape: tuple[int, ...], dtype: torch.dtype, name: str,
                     shm_dir: Path = SHM_DIR) -> tuple[torch.Tensor, KVPoolHandle]:
    """Create a zeroed shared segment and view it as a tensor of `shape` (CPU).

    shape: [num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim]
    """
    numel = _check_shape(shape)
    num_bytes = numel * torch.empty((), dtype=dtype).element_size()
    path = Path(shm_dir) / name
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        raise ValueError(f"shared-memory segment {path} already exists; another instance uses "
                         "this name, or a crashed one left it (see cleanup_stale_segments)") from None
    try:
        os.ftruncate(fd, num_bytes)
        buf = mmap.mmap(fd, num_bytes, flags=mmap.MAP_SHARED,
                        prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        _unlink_quietly(path)
        raise
    os.close(fd)
    handle = KVPoolHandle(name, path, num_bytes, owner=True, _mmap=buf)
    handle._finalizer = weakref.finalize(handle, _unlink_quietly, path)
    kv = torch.frombuffer(buf, dtype=dtype, count=numel).view(*shape)
    return kv, handle


def attach_kv_pool(name: str, shape: tuple[int, ...], dtype: torch.dtype,
                   shm_dir: Path = SHM_DIR) -> tuple[torch.Tensor, KVPoolHandle]:
    """Map another instance's pool read-only. Writing into the tensor is a bug (SIGSEGV)."""
    if segment_owner(name) is None:
        raise ValueError(f"{name!r} is not a splitserve shared-memory segment name")
    numel = _check_shape(shape)
    num_bytes = numel * torch.empty((), dtype=dtype).element_size()
    path = Path(shm_dir) / name
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except (FileNotFoundError, OSError):
        raise ValueError(f"no shared-memory segment {path}: is the prefill instance on this "
                         "host and running with --kv-transport shm?") from None
    try:
        stat = os.fstat(fd)
        if stat.st_uid != os.getuid():
            raise ValueError(f"segment {path} belongs to uid {stat.st_uid}, not to us: refusing a "
                             "pool another user could have planted")
        actual = stat.st_size
        if actual != num_bytes:
            raise ValueError(f"segment {path} holds {actual} bytes but shape {tuple(shape)} of "
                             f"{dtype} needs {num_bytes}: the two instances disagree on the pool")
        buf = mmap.mmap(fd, num_bytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "buffer is not writable": on purpose
        kv = torch.frombuffer(buf, dtype=dtype, count=numel).view(*shape)
    return kv, KVPoolHandle(name, path, num_bytes, owner=False, _mmap=buf)


def cleanup_stale_segments(shm_dir: Path = SHM_DIR) -> list[str]:
    """Remove segments whose owner process is gone (it was killed before it could)."""
    removed = []
    for path in Path(shm_dir).glob(f"{SEGMENT_PREFIX}*"):
        match = _STALE_RE.match(path.name)
        if match and not _pid_alive(int(match.group(1))):
            _unlink_quietly(path)
            removed.append(path.name)
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True
