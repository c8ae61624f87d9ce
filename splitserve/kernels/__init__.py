"""Optional C++ CPU kernels (GGUF block matmul, paged decode and prefill attention, the fused elementwise ops
between them), built by `make setup`; pure-torch code stands in
when they are absent (no compiler, or an out-of-date build), with the same results.

    python -m splitserve.kernels.build   # what `make setup` runs; prints the ISA in use
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import logging
import os
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

NAME = "splitserve_gguf_kernels"
SOURCES = [Path(__file__).with_name(name) for name in ("gguf_linear.cpp", "paged_attention.cpp", "prefill_attention.cpp",
                                                                "fused_ops.cpp")]
HEADERS = [Path(__file__).with_name("vec_math.h")]  # not compiled alone; a change still makes the build stale
BUILD_DIR = Path(__file__).with_name("_build")
# -ffp-contract=off keeps d * q + m a multiply then an add, as gguf-py does. -fopenmp: ATen's
# parallel_for is inline OpenMP, so without it the kernels run on one thread whatever
# torch.set_num_threads says.
CFLAGS = ["-O3", "-ffp-contract=off", "-fopenmp"]
LDFLAGS = ["-fopenmp"]
# Two in-process engines (tests, `serve` with in-process instances) may load the kernels at the same
# moment: functools.cache does not stop both from initialising the extension, and one of them
# then saw a module without its functions. One load at a time.
_LOAD_LOCK = threading.Lock()


def built_library() -> Path | None:
    found = sorted(BUILD_DIR.glob(f"{NAME}*.so"))
    return found[0] if found else None


_LOADED: list = []  # [the module or None] once looked for


def load():
    """The compiled module, or None (then callers use their torch fallback). Never compiles."""
    if _LOADED:  # the engines call this on every layer: no lock once loaded
        return _LOADED[0]
    with _LOAD_LOCK:
        if not _LOADED:
            _LOADED.append(_load())
        return _LOADED[0]


KERNELS_ENV = "SPLITSERVE_KERNELS"  # "off": use the pure-torch path even where the kernels are built


def _load():
    if os.environ.get(KERNELS_ENV, "").strip().lower() in ("off", "0", "false", "no"):
        log.info("GGUF kernels switched off (%s=%s); using the pure-torch path", KERNELS_ENV, os.environ[KERNELS_ENV])
        return None
    path = built_library()
    if path is None:
        log.info("GGUF kernels not built (run `make setup`); using the pure-torch fallback")
        return None
    if any(path.stat().st_mtime < source.stat().st_mtime for source in SOURCES + HEADERS):
        log.warning("GGUF kernels at %s are older than their sources; using the pure-torch "
                    "fallback until `make setup` rebuilds them", path)
        return None
    spec = importlib.util.spec_from_file_location(NAME, path,
                                                  loader=importlib.machinery.ExtensionFileLoader(NAME, str(path)))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


load.cache_clear = _LOADED.clear  # after a build, the next load() looks again


def switch_off() -> None:
    """The pure-torch path for the rest of this process (EngineConfig.kernels == "off"): an
    engine process serves one engine, so its setting is the process's."""
    with _LOAD_LOCK:
        if _LOADED != [None]:
            log.info("GGUF kernels switched off (EngineConfig.kernels); using the pure-torch path")
        _LOADED[:] = [None]


def applies_to(device: torch.device | str, dtype) -> bool:
    """Whether the C++ kernels may read tensors of this device and dtype: they are CPU code on
    fp32 memory, and a CUDA (or meta) tensor handed to them would be read as a host pointer."""
    return torch.device(device).type == "cpu" and dtype == torch.float32


def for_tensor(x):
    """The kernels module for an op on `x`, or None: the torch path (any device, any dtype)."""
    return load() if applies_to(x.device, x.dtype) else None
