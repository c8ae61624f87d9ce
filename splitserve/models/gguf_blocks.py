"""Matrices kept in their GGUF block format (Q4_1, Q8_0) and the linear layer that reads them.

A decode step at small batch is bound by the bytes of weights it streams: the bundled model's
Q4_1 blocks are 0.75 bytes a weight here against fp32's 4. `linear` multiplies by the blocks
directly with splitserve.kernels (C++, AVX-512 / AVX2 chosen at run time) while the batch is
small, and above `MAX_KERNEL_ROWS` rows, where fp32 GEMM is faster than dequantizing in
registers, dequantizes the matrix and calls F.linear. Either way each weight is exactly the
fp32 value gguf-py's dequantize gives, so only the order of the fp32 sums differs from the fp32
path. Without the compiled kernels the same results come from pure torch (slower).

Where the two paths cross depends on the CPU: 64 rows on the AVX-512 EPYC it was measured on, 21-42
rows for the per-layer matrices on an AVX-512/AMX Xeon (session 28: a 64-token prompt step 140 ms on
the kernels, 122 ms dequantized; docs/benchmarks.md "Engine"). So an engine measures it when
it loads (`calibrate_kernel_rows`: each matrix shape on both paths at two row counts, the crossing of
the two lines), unless told a number (serve --kernel-rows).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from splitserve import kernels

BLOCK = 32
# name -> (kernel format id, bytes of quantized values per block)
FORMATS = {"q4_1": (0, 16), "q8_0": (1, 32)}
# Rows of x up to which the block kernel beats dequantize + fp32 GEMM (measured on AVX-512 EPYC,
# bench/engine.py "Engine" in docs/benchmarks.md): decode batches run on the blocks, prefill on fp32.
MAX_KERNEL_ROWS = 64  # the default, and each matrix's until calibrate_kernel_rows measures its own
# calibrate_kernel_rows: the row counts it times both paths at, and the bounds of what it chooses
CALIBRATION_ROWS = (16, 64)
MIN_KERNEL_ROWS = 8    # one tile of the kernel (kMR): a decode batch this small is never dequantized
MAX_CALIBRATED_ROWS = 256
# weight_format 'gguf-q8act': rows of x up to which activations are quantized to 8 bits (Q8_1, per
# 32-block) and multiplied in integers (kernels' linear_q8): a decode step of one or two streams.
INT8_ROWS = 2


@dataclass(slots=True)
class GGUFBlocks:
    """One [N, K] matrix: per row, K / 32 blocks of fp32 scale d (and offset m for Q4_1) and
    32 quantized values, stored apart so a kernel streams each as one array."""

    fmt: str  # "q4_1" | "q8_0"
    qs: torch.Tensor  # uint8 [N, K / 2] (q4_1: byte j of a block holds values j and j + 16) or [N, K] (q8_0)
    d: torch.Tensor  # float32 [N, K / 32]
    m: torch.Tensor | None  # float32 [N, K / 32] for q4_1, None for q8_0
    int8_rows: int = 0  # x with at most this many rows takes 8-bit activations (weight_format gguf-q8act)
    kernel_rows: int = MAX_KERNEL_ROWS  # x with more rows is dequantized and multiplied by F.linear

    @property
    def shape(self) -> tuple[int, int]:
        return self.qs.shape[0], self.d.shape[1] * BLOCK

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.m) if t is not None)

    @classmethod
    def from_gguf(cls, fmt: str, raw: np.ndarray, shape: tuple[int, int]) -> GGUFBlocks:
        """raw: the tensor's bytes as stored in the file (blocks of f16 d, [f16 m,] values)."""
        n, k = shape
        if fmt not in FORMATS:
            raise ValueError(f"GGUF block format {fmt!r} has no kernel; supported: {', '.join(FORMATS)}")
        if k % BLOCK:
            raise ValueError(f"a {fmt} matrix needs a multiple of {BLOCK} columns, got {k}")
        head = 4 if fmt == "q4_1" else 2
        blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(n, k // BLOCK, head + FORMATS[fmt][1])
        scales = blocks[:, :, :head].copy().view(np.float16).astype(np.float32)  # [n, k/32, 1 or 2]
        return cls(fmt=fmt, qs=torch.from_numpy(blocks[:, :, head:].reshape(n, -1).copy()),
                   d=torch.from_numpy(np.ascontiguousarray(scales[:, :, 0])),
                   m=torch.from_numpy(np.ascontiguousarray(scales[:, :, 1])) if fmt == "q4_1" else None)

    def rows(self, order: torch.Tensor) -> GGUFBlocks:
        """The same matrix with its rows taken in `order` (e.g. undoing llama.cpp's rotary permutation)."""
        pick = lambda t: None if t is None else t[order].contiguous()  # noqa: E731
        return GGUFBlocks(self.fmt, pick(self.qs), pick(self.d), pick(self.m), self.int8_rows, self.kernel_rows)

    @staticmethod
    def cat(parts: list[GGUFBlocks]) -> GGUFBlocks:
        """Stack matrices of one format by rows (q/k/v and gate/up become one matmul each)."""
        fmt = parts[0].fmt
        if any(p.fmt != fmt for p in parts):
            raise ValueError(f"cannot fuse matrices of different GGUF formats: {[p.fmt for p in parts]}")
        return GGUFBlocks(fmt, torch.cat([p.qs for p in parts]), torch.cat([p.d for p in parts]),
                          None if fmt == "q8_0" else torch.cat([p.m for p in parts]),
                          min(p.int8_rows for p in parts), min(p.kernel_rows for p in parts))

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K], equal bit for bit to gguf-py's dequantize of the same blocks."""
        module = kernels.load() if self.qs.device.type == "cpu" else None
        if module is not None:
            return module.dequantize(self.qs, self.d, self._m(), FORMATS[self.fmt][0])
        return dequantize_torch(self)

    def _m(self) -> torch.Tensor:
        return self.m if self.m is not None else self.d.new_empty(0)


def quantized_values(w: GGUFBlocks) -> torch.Tensor:
    """The blocks' integers, [N, K / 32, 32]: Q4_1's 0..15 (byte j holds values j and j + 16), Q8_0's -128..127."""
    n, k = w.shape
    if w.fmt == "q4_1":
        qs = w.qs.view(n, k // BLOCK, BLOCK // 2)
        return torch.cat([qs & 0x0F, qs >> 4], dim=-1)
    return w.qs.view(torch.int8).view(n, k // BLOCK, BLOCK)


def dequantize_torch(w: GGUFBlocks) -> torch.Tensor:
    n, k = w.shape
    q = quantized_values(w).float()  # [n, k/32, 32]
    if w.fmt == "q4_1":
        return (w.d.unsqueeze(-1) * q + w.m.unsqueeze(-1)).view(n, k)
    return (q * w.d.unsqueeze(-1)).view(n, k)


def linear(x: torch.Tensor, weight: torch.Tensor | GGUFBlocks, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for fp32 or block-format weights. x: [M, K] -> [M, N]."""
    if isinstance(weight, torch.Tensor):
        return F.linear(x, weight, bias)
    module = kernels.for_tensor(x)
    if x.shape[0] <= weight.int8_rows and x.dtype == torch.float32:
        out = (linear_q8_torch(x, weight) if module is None else
               module.linear_q8(x, weight.qs, weight.d, weight._m(), FORMATS[weight.fmt][0]))
        return out if bias is None else out.add_(bias)
    if module is None or x.shape[0] > weight.kernel_rows or x.dtype != torch.float32:
        return F.linear(x, weight.dequantize().to(x.dtype), bias)
    out = module.linear(x, weight.qs, weight.d, weight._m(), FORMATS[weight.fmt][0])
    return out if bias is None else out.add_(bias)


def quantize_q8_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] per 32-block as llama.cpp's Q8_1: (q int32 [M, K/32, 32], d [M, K/32], s = d * sum(q))."""
    blocks = x.reshape(x.shape[0], -1, BLOCK)
    amax = blocks.abs().amax(dim=-1)
    d = amax / 127.0
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(blocks * inv.unsqueeze(-1)).to(torch.int32)  # half to even, as nearbyint
    return q, d, d * q.sum(-1).float()


def linear_q8_torch(x: torch.Tensor, w: GGUFBlocks) -> torch.Tensor:
    """The kernels' linear_q8 in torch (the reference its tests compare against, and the fallback):
    per block d_w d_x sum(q_w q_x) (+ m_w s_x for Q4_1), the integer sums exact."""
    q, d, s = quantize_q8_torch(x)  # [M, nb, 32], [M, nb], [M, nb]
    wq = quantized_values(w)  # [N, nb, 32]
    isum = torch.einsum("mbk,nbk->mnb", q.to(torch.float64), wq.to(torch.float64))  # exact: |sum| < 2^22
    out = (isum * (d.unsqueeze(1) * w.d.unsqueeze(0)).to(torch.float64)).sum(-1)
    if w.fmt == "q4_1":
        out = out + (s.unsqueeze(1) * w.m.unsqueeze(0)).to(torch.float64).sum(-1)
    return out.float()


def crossover_rows(kernel_s: tuple[float, float], dense_s: tuple[float, float],
                   rows: tuple[int, int] = CALIBRATION_ROWS) -> int:
    """The most rows of x for which the block kernel is predicted faster than dequantize + F.linear,
    from each path's time at two row counts (a line through each: the kernel's cost grows faster
    per row, the dense path pays the dequantization once), within [MIN_KERNEL_ROWS, MAX_CALIBRATED_ROWS]."""
    (m0, m1), (k0, k1), (d0, d1) = rows, kernel_s, dense_s
    kernel_slope, dense_slope = (k1 - k0) / (m1 - m0), (d1 - d0) / (m1 - m0)
    if kernel_slope <= dense_slope:  # the dense path never catches up (or the timings are noise)
        return MAX_CALIBRATED_ROWS if k1 <= d1 else MIN_KERNEL_ROWS
    cross = m0 + (d0 - k0) / (kernel_slope - dense_slope)
    return int(min(max(cross, MIN_KERNEL_ROWS), MAX_CALIBRATED_ROWS))


def _fastest(fn: Callable[[], object], repeats: int, clock: Callable[[], float], budget_s: float = 0.05) -> float:
    """The fastest of `repeats` calls after a first one (allocation, caches), or of as many as fit
    in `budget_s` once two have run: the lm_head's dense path alone takes ~60 ms a call on one core."""
    fn()
    best, spent = float("inf"), 0.0
    for i in range(repeats):
        if i >= 2 and spent > budget_s:
            break
        start = clock()
        fn()
        took = clock() - start
        best, spent = min(best, took), spent + took
    return best


def time_both_paths(w: GGUFBlocks, m: int, repeats: int = 5,
                    clock: Callable[[], float] = time.perf_counter) -> tuple[float, float] | None:
    """Seconds of x[m, K] @ w on the block kernel and on dequantize + F.linear (the fastest of up
    to `repeats`, on this process's torch threads), or None where the kernels cannot run."""
    x = torch.randn(m, w.shape[1], generator=torch.Generator().manual_seed(m))
    module = kernels.for_tensor(x) if w.qs.device.type == "cpu" else None
    if module is None:
        return None

    def blocks():
        return module.linear(x, w.qs, w.d, w._m(), FORMATS[w.fmt][0])

    def dense():
        return F.linear(x, w.dequantize())

    return _fastest(blocks, repeats, clock), _fastest(dense, repeats, clock)


def calibrate_kernel_rows(matrices: Iterable[GGUFBlocks],
                          time_paths: Callable[[GGUFBlocks, int], tuple[float, float] | None] = time_both_paths
                          ) -> dict[tuple[str, int, int], int]:
    """Times one matrix of each distinct (format, N, K) among `matrices` on both paths at
    CALIBRATION_ROWS rows (time_paths), sets every matrix's kernel_rows to where the two lines
    cross (crossover_rows) and returns them by shape. The first shape is timed twice and the first
    result thrown away (a freshly loaded model's first calls ran up to 2x slow). Shapes the kernels
    cannot run are left as they are. Only speed depends on it: either path gives every weight
    gguf-py's fp32 value."""
    groups: dict[tuple[str, int, int], list[GGUFBlocks]] = {}
    for w in matrices:
        groups.setdefault((w.fmt, *w.shape), []).append(w)
    order = list(groups.items())
    chosen: dict[tuple[str, int, int], int] = {}
    for n, (key, members) in enumerate(order[:1] + order):
        timed = [time_paths(members[0], m) for m in CALIBRATION_ROWS]
        if n == 0 or any(t is None for t in timed):
            continue  # the warm-up pass, or no kernels for this matrix
        rows = crossover_rows((timed[0][0], timed[1][0]), (timed[0][1], timed[1][1]))
        for member in members:
            member.kernel_rows = rows
        chosen[key] = rows
    return chosen


def set_kernel_rows(matrices: Iterable[GGUFBlocks], rows: int) -> None:
    """A fixed crossover for every matrix (serve --kernel-rows N)."""
    if not (isinstance(rows, int) and not isinstance(rows, bool) and rows >= 0):
        raise ValueError(f"kernel_rows must be a whole number >= 0, got {rows!r}")
    for w in matrices:
        w.kernel_rows = rows
