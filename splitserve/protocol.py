"""Every message that crosses a socket between the frontend and the engines.

Transport: ZeroMQ. The frontend binds one ROUTER socket; each engine connects two DEALER
sockets to it, identities `<engine_id>/in` (requests and aborts in, hello out) and
`<engine_id>/out` (outputs, stats and heartbeats out), so each socket has exactly one owning
thread on the engine side. Every frame is one msgpack-encoded, tagged msgspec struct; both
sides decode with one `Decoder` over the union below and drop (and log) anything else.
No pickle, eval or exec on any input path.

Lifecycle of an engine connection:
    engine -> EngineHello (on /in: the frontend may now route to it)
    frontend -> GenerateRequest | AbortRequests | Shutdown  (to /in)
    engine -> StepOutputs | EngineStats | Heartbeat         (from /out)
"""
from __future__ import annotations

import msgspec

from splitserve.config import ROLES

PROTOCOL_VERSION = 1


class WireSamplingParams(msgspec.Struct, frozen=True):
    """SamplingParams as sent on the wire (the engine rebuilds and re-validates them)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] = []
    ignore_eos: bool = False


class KVHandover(msgspec.Struct, frozen=True):
    """Room for disaggregation (issue 4): where a request's KV comes from or goes to.

    On a prefill instance, `send_to_instance` names the decode instance that will pull the
    blocks; on a decode instance, `source_instance` and `source_blocks` say where the
    prefilled KV lives. Colocated requests carry no handover.
    """

    send_to_instance: str | None = None
    source_instance: str | None = None
    source_blocks: list[int] = []
    transfer_id: str | None = None


# ---- frontend -> engine -------------------------------------------------------------------

class GenerateRequest(msgspec.Struct, tag="generate", frozen=True):
    request_id: str
    prompt_token_ids: list[int]
    params: WireSamplingParams
    prefill_only: bool = False  # prefill role: compute KV + first token, then hand over
    kv: KVHandover | None = None


class AbortRequests(msgspec.Struct, tag="abort", frozen=True):
    request_ids: list[str]


class Shutdown(msgspec.Struct, tag="shutdown", frozen=True):
    reason: str = ""


# ---- engine -> frontend -------------------------------------------------------------------

class EngineHello(msgspec.Struct, tag="hello", frozen=True):
    """Sent once the model is loaded and the KV cache allocated: the engine is ready."""

    engine_id: str
    role: str
    model_name: str
    max_model_len: int
    vocab_size: int
    num_blocks_total: int
    block_size: int
    max_num_seqs: int
    pid: int
    protocol_version: int = PROTOCOL_VERSION


class TokenOutput(msgspec.Struct, frozen=True, array_like=True):
    """One request's news from one engine step (array_like: this is the hot path)."""

    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | "prefill_done"
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    rejected: bool = False  # the engine refused the request at admission (a user error)


class StepOutputs(msgspec.Struct, tag="outputs", frozen=True):
    engine_id: str
    outputs: list[TokenOutput]


class EngineStats(msgspec.Struct, tag="stats", frozen=True):
    engine_id: str
    role: str
    num_waiting: int
    num_running: int
    num_blocks_total: int
    num_free_blocks: int
    prefix_cache_queries: int = 0  # tokens looked up
    prefix_cache_hits: int = 0  # tokens found
    num_preemptions: int = 0
    num_steps: int = 0


class Heartbeat(msgspec.Struct, tag="heartbeat", frozen=True):
    """Sent by the engine's output thread even during a long forward pass: 'still alive'."""

    engine_id: str


ToEngine = GenerateRequest | AbortRequests | Shutdown
FromEngine = EngineHello | StepOutputs | EngineStats | Heartbeat


def check_role(role: str) -> str:
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    return role


def socket_identity(engine_id: str, direction: str) -> bytes:
    """ROUTER identity of one of an engine's two sockets; direction is 'in' or 'out'."""
    return f"{engine_id}/{direction}".encode()


class Codec:
    """Encoder plus one decoder per direction; each side owns its own (they hold buffers)."""

    def __init__(self) -> None:
        self.encoder = msgspec.msgpack.Encoder()
        self.to_engine = msgspec.msgpack.Decoder(ToEngine)
        self.from_engine = msgspec.msgpack.Decoder(FromEngine)

    def encode(self, message: ToEngine | FromEngine) -> bytes:
        return self.encoder.encode(message)
