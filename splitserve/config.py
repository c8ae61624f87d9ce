"""Settings for the model, the KV cache, the scheduler and the engine.

Every setting object validates itself once, at construction, and raises a
ValueError that names the field and says what would be accepted.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from splitserve.kv_transfer.config import KVTransferConfig
from splitserve.roles import ROLES

# A prefill instance's prompt tokens per step while streams it inherited from an earlier role
# (colocated or decode) still decode there: the decode role's default local-prefill chunk
# (coordinator/disagg_policy.py DEFAULT_CHUNK_TOKENS), which keeps such steps near a decode step.
CARRIED_CHUNK_TOKENS = 64

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
PREFILL_POLICIES = ("chunked", "whole")
SCHEDULING_POLICIES = ("fcfs", "priority")
PRIORITY_BOUNDS = (-(2**31), 2**31 - 1)  # a request's priority: a 32-bit integer, lower first
WEIGHT_FORMATS = ("auto", "fp32", "gguf", "gguf-q8act")  # models/loader.py says what each means
# weights, activations and KV (devices.py maps them to torch); bfloat16 is what a GPU serves in
DTYPES = ("float32", "bfloat16", "float16")
KERNEL_MODES = ("auto", "off")


@dataclass(slots=True)
class ModelConfig:
    """Shape of a Llama-family decoder. Loaders fill it; the forward pass reads it."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm on q and k per head
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; "
                f"splitserve supports {', '.join(SUPPORTED_ARCHITECTURES)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model config: {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model config: num_heads ({self.num_heads}) must be a multiple "
                             f"of num_kv_heads ({self.num_kv_heads})")
        self.eos_token_ids = tuple(self.eos_token_ids)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token occupies across all layers, at fp32."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 4


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*$", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """'1GiB' -> 1073741824, '512MB' -> 512000000, 4096 -> 4096."""
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(f"cannot read {text!r} as a size; write e.g. '1GiB', '512MiB' or '2000000'")
    number, unit, binary = float(m.group(1)), m.group(2).upper(), m.group(3)
    base = 1024 if binary or unit == "" else 1000
    power = " KMGT".index(unit) if unit else 0
    return int(number * base**power)


@dataclass(slots=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_memory: int = 1 << 30  # bytes for the whole paged KV pool, allocated once
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        self.kv_cache_memory = parse_size(self.kv_cache_memory)
        if self.kv_cache_memory <= 0:
            raise ValueError("kv_cache_memory must be positive")

    def num_blocks(self, model: ModelConfig) -> int:
        n = self.kv_cache_memory // (model.kv_bytes_per_token * self.block_size)
        if n < 2:
            raise ValueError(
                f"kv_cache_memory={self.kv_cache_memory} bytes holds fewer than 2 blocks of "
                f"{self.block_size} tokens ({model.kv_bytes_per_token} bytes/token); raise it")
        return int(n)


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 256
    prefill_policy: str = "chunked"
    scheduling_policy: str = "fcfs"  # priority: lower `priority` first, then arrival (as vLLM)

    def __post_init__(self) -> None:
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(
                f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")
        if self.prefill_policy not in PREFILL_POLICIES:
            raise ValueError(f"prefill_policy must be one of {PREFILL_POLICIES}, "
                             f"got {self.prefill_policy!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, "
                             f"got {self.scheduling_policy!r}")


@dataclass(slots=True)
class EngineConfig:
    """Built and checked once (by `serve`, `splitserve engine` or a test) and handed to the engine
    process as is: `protocol.encode_engine_config` puts it on the wire with msgspec."""

    model: str | None = None  # None: the bundled SmolLM2-135M-Instruct GGUF
    device: str = "cpu"
    num_threads: int | None = None  # torch intra-op threads; None leaves torch's default
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    seed: int = 0
    instance_id: str = "engine-0"
    role: str = "colocated"  # the first connector; a live role change swaps it (engine/connectors.py)
    # How KV moves between instances; None: this instance can only ever be colocated
    kv_transfer: KVTransferConfig | None = None
    kv_failure_policy: str = "recompute"  # decode role, when a transfer fails: recompute | fail
    weight_format: str = "auto"  # fp32 | gguf (keep Q4_1/Q8_0 blocks) | auto (gguf when it can run)
    # The engine link's shared secret (CurveZMQ keys derive from it): `serve` hands it over here,
    # on the engine's stdin, never on a command line or in the environment. None: --engine-secret-file.
    link_secret: bytes | None = field(default=None, repr=False)
    dtype: str = "float32"  # of weights, activations and the KV pool: one of DTYPES
    # decode role: prompt tokens per step when it prefills a prompt itself (serve --disagg-policy
    # threshold | auto); None: max_num_batched_tokens alone bounds them. Prefill role: the same
    # beside streams it inherited from an earlier role; None: CARRIED_CHUNK_TOKENS
    local_prefill_chunk_tokens: int | None = None
    # auto: the C++ CPU kernels where they are built and apply; off: the pure-torch path (serve
    # --kernels off, the engine before issue 16, for before/after trials)
    kernels: str = "auto"
    # GGUF block matrices: rows of x up to which the C++ kernel multiplies by the blocks, past which
    # the matrix is dequantized for F.linear (serve --kernel-rows). None: measured per matrix shape
    # when the engine loads (models/gguf_blocks.calibrate_kernel_rows; the crossing is CPU-specific)
    kernel_rows: int | None = None

    def __post_init__(self) -> None:
        if self.kernels not in KERNEL_MODES:
            raise ValueError(f"kernels must be one of {KERNEL_MODES}, got {self.kernels!r}")
        if self.kernel_rows is not None and (isinstance(self.kernel_rows, bool) or not isinstance(self.kernel_rows, int)
                                             or self.kernel_rows < 0):
            raise ValueError(f"kernel_rows must be a whole number >= 0 or None (measure), got {self.kernel_rows!r}")
        if self.local_prefill_chunk_tokens is not None and self.local_prefill_chunk_tokens <= 0:
            raise ValueError(f"local_prefill_chunk_tokens must be positive, got {self.local_prefill_chunk_tokens}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.num_threads is not None and self.num_threads <= 0:
            raise ValueError(f"num_threads must be positive, got {self.num_threads}")
        if self.weight_format not in WEIGHT_FORMATS:
            raise ValueError(f"weight_format must be one of {WEIGHT_FORMATS}, got {self.weight_format!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.kv_failure_policy not in ("recompute", "fail"):
            raise ValueError(f"kv_failure_policy must be 'recompute' or 'fail', got {self.kv_failure_policy!r}")
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.role != "colocated" and self.kv_transfer is None:
            raise ValueError(f"role {self.role!r} needs a KV transfer setting (e.g. --kv-transport shm)")
