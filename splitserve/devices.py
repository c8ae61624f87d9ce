"""Where an engine's tensors live: the device and dtype its EngineConfig names, checked once.

    device = check_device("cuda")   # torch.device, or DeviceUnavailable with the fix in its message
    dtype = torch_dtype("bfloat16")  # weights, activations and the KV pool
    synchronize(device)              # before reading a clock: CUDA kernels run ahead of Python

The C++ CPU kernels (splitserve.kernels) read fp32 CPU tensors only; `kernels.for_tensor(x)` is
the one place that decides, from the tensor itself, whether they apply.
"""
from __future__ import annotations

import torch

from splitserve.config import DTYPES


class DeviceUnavailable(ValueError):
    """The device a user asked for is not on this machine (a user error, not a bug)."""


def check_device(name: str) -> torch.device:
    """torch.device(name), once it is known to exist here: 'cuda' on a machine (or a torch build)
    without CUDA is refused with one line saying what to run instead."""
    device = torch.device(name)
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise DeviceUnavailable(f"device {name!r} is not supported; use 'cpu' or 'cuda[:N]'")
    if not torch.cuda.is_available():
        build = f"torch {torch.__version__}" + ("" if torch.version.cuda else ", a build without CUDA")
        raise DeviceUnavailable(f"--device {name}: no CUDA device is visible here ({build}); "
                                "run with --device cpu, or on a machine with an NVIDIA GPU and a CUDA build of torch")
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise DeviceUnavailable(f"--device {name}: this machine has {count} CUDA device(s), "
                                f"numbered 0..{count - 1}")
    return device


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return getattr(torch, name)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU, whose ops return when done)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
