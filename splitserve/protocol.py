"""Every message that crosses a socket between the frontend and the engines (and, with
`serve --api-server-count N`, between the coordinator and its API processes: the section so named below).

Transport: ZeroMQ. The frontend binds one ROUTER socket; each engine connects two DEALER
sockets to it, identities `<engine_id>/in` (requests and aborts in, hello out) and
`<engine_id>/out` (outputs, stats and heartbeats out), so each socket has exactly one owning
thread on the engine side. Every frame is one msgpack-encoded, tagged msgspec struct; both
sides decode with one `Decoder` over the union below and drop (and log) anything else.
Only msgspec structs cross a socket; nothing on an input path evaluates code.

Lifecycle of an engine connection:
    engine -> EngineHello (on /in: the frontend may now route to it)
    frontend -> GenerateRequest | AbortRequests | SetRole | SetChunkTokens | SetStreamCap | ReleaseUnstarted
                | Shutdown  (to /in)
    engine -> StepOutputs | EngineStats | RoleChanged | Released | Heartbeat     (from /out)

The engine's settings cross the process boundary once, at start: `serve` builds and checks an
`EngineConfig` and writes `encode_engine_config(config)` to the engine process's stdin.

Disaggregated prefill/decode: a prefill instance's last TokenOutput of a request has
finish_reason "prefill_done", the first token and a `TransferDescriptor` (kv_transfer's own
struct, reused here: where the KV waits, under a lease); the frontend forwards it with the
first token in the decode instance's GenerateRequest; the decode instance's final TokenOutput
carries a `KVTransferReport` whose `outcome` (ok | recomputed | failed) the decode instance
decided; the frontend passes it on as is. EngineStats of both roles carry `KVStats`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from splitserve.config import ROLES
from splitserve.kv_transfer.messages import TransferDescriptor

if TYPE_CHECKING:
    from splitserve.config import EngineConfig

PROTOCOL_VERSION = 14  # 2: KV handover fields; 3: live role changes, the engine decides the KV outcome;
# 4: priority; 5: logprobs, structured output; 6: grammars (tool calls), prompt logprobs; 7: step samples;
# 8: a step sample's loop time; 9: SetChunkTokens; 10: a step sample's CPU time;
# 11: an API request's SLO class; 12: the prompts a new decode instance hands back;
# 13: ReleaseUnstarted / Released; 14: SetStreamCap, a request's TTFT deadline


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
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    json_schema: str | None = None
    grammar: str | None = None
    answer_prefix_len: int = 0


class TokenLogprobs(msgspec.Struct, frozen=True, array_like=True):
    """One sampled token's log-probability under the model (raw logits, before temperature and
    the other sampling settings, as vLLM reports it) and the top alternatives, most likely first."""

    token_id: int
    logprob: float
    top_token_ids: list[int] = []
    top_logprobs: list[float] = []


class KVTransferReport(msgspec.Struct, frozen=True):
    """What a decode instance says about the transfer of one request's KV (the reported subset
    of kv_transfer's TransferRecord); rides on the request's final output."""

    outcome: str  # "ok" | "recomputed" | "failed": decided by the decode instance's connector
    source_instance: str = ""
    transport: str = ""
    num_bytes: int = 0
    seconds: float = 0.0  # bytes moving, start to end
    wait_seconds: float = 0.0  # descriptor arrived -> bytes started (waiting for blocks / a puller)
    error: str = ""
    error_kind: str = ""  # injected | network | source_gone | auth | no_space | ...


# ---- frontend -> engine -------------------------------------------------------------------

class GenerateRequest(msgspec.Struct, tag="generate", frozen=True):
    request_id: str
    prompt_token_ids: list[int]
    params: WireSamplingParams
    # decode role: the prompt's KV waits on a prefill instance, which produced first_token_ids
    kv_descriptor: TransferDescriptor | None = None
    first_token_ids: list[int] = []
    priority: int = 0  # lower first under --scheduling-policy priority, in every stage
    # seconds until its first token is due (its SLO class's TTFT target, less what it waited in the
    # frontend; <= 0: already late); None: no deadline. The engine queues late prompts behind
    # those that can still meet theirs (Scheduler: late prompts last)
    ttft_due_in_s: float | None = None


class AbortRequests(msgspec.Struct, tag="abort", frozen=True):
    request_ids: list[str]


class Shutdown(msgspec.Struct, tag="shutdown", frozen=True):
    reason: str = ""


class ResendHello(msgspec.Struct, tag="resend_hello", frozen=True):
    """From a frontend that does not know the sender (it restarted on the same address): an engine
    drops what it held for the old frontend, whose ids the new one may reuse, and says hello again."""


class SetRole(msgspec.Struct, tag="set_role", frozen=True):
    """Swap the connector once the old one has nothing in flight; answered with RoleChanged."""

    role: str


class ReleaseUnstarted(msgspec.Struct, tag="release_unstarted", frozen=True):
    """Drop those of these requests that still wait untouched here (no token computed or generated,
    never preempted); answered with Released, naming the ones dropped, for the frontend to place
    again (a decode instance leaving its role need not wait for prompts not yet begun)."""

    request_ids: list[str]


class SetChunkTokens(msgspec.Struct, tag="set_chunk_tokens", frozen=True):
    """The prompt tokens a step may carry beside streams that answer there, from now on and under
    any later role (the mix controller's chunk-budget knob); 0: each role's own again. No answer."""

    tokens: int


class SetStreamCap(msgspec.Struct, tag="set_stream_cap", frozen=True):
    """The streams the instance may hold from now on (the mix controller's stream cap): requests
    that would answer there wait once that many run; 0: max_num_seqs alone. No answer."""

    streams: int


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
    kv_descriptor: TransferDescriptor | None = None  # prefill role, with "prefill_done"
    kv_transfer: KVTransferReport | None = None  # decode role, on the final output
    logprobs: list[TokenLogprobs] | None = None  # one per new token, when the request asked
    # prompt tokens 1..n-1 (the first has no logprob), with the first token, when the request asked
    prompt_logprobs: list[TokenLogprobs] | None = None


class StepOutputs(msgspec.Struct, tag="outputs", frozen=True):
    engine_id: str
    outputs: list[TokenOutput]


class KVStats(msgspec.Struct, frozen=True):
    """An instance's KV-transfer counters since start (SenderStats / ReceiverStats)."""

    num_lease_expiries: int = 0  # prefill: handed-over KV nobody pulled in time
    num_held_blocks: int = 0  # prefill: blocks waiting for a decode instance now
    num_confirmed: int = 0  # prefill
    num_done: int = 0  # decode
    num_failed: int = 0  # decode
    num_pending: int = 0  # decode: waiting for blocks or a puller
    num_transferring: int = 0  # decode


class StepSample(msgspec.Struct, frozen=True, array_like=True):
    """One model step as it ran: its shape in the step-time model's features (control/stepmodel.py)
    and its seconds. The mix controller refits its step model on these (control/online_stepmodel.py)."""

    prefill_tokens: int
    prefill_attn_ktok2: float  # summed over the step's chunks, as stepfeatures.prefill_attn_ktok2 defines it
    decode_seqs: int
    decode_kv_tokens: int  # the decodes' context lengths, each token being decoded included
    seconds: float  # the model's forward and sampling (ModelRunner.execute)
    # the engine loop's whole turn around this step, when it ran busy from the turn before (no
    # wait for work): messages in, scheduling, the step, outputs out; 0 where unknown
    loop_seconds: float = 0.0
    # the engine thread's CPU time during `seconds` (time.thread_time): below `seconds` when the
    # thread waited for a core that another process held; 0 where unknown (older engines)
    cpu_seconds: float = 0.0


# GET /admin/steps and a trial's `engine_steps` give each step as a list of these, in this order
STEP_SAMPLE_FIELDS = tuple(f.name for f in msgspec.structs.fields(StepSample))


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
    kv: KVStats | None = None  # prefill and decode roles
    block_size: int = 16
    num_queued_prompt_tokens: int = 0  # prompt tokens waiting or not yet prefilled
    step_seconds: float = 0.0  # moving average of recent model steps
    step_tokens: float = 0.0  # ... and of the tokens each carried
    num_role_changes: int = 0
    step_samples: list[StepSample] = []  # the steps run since the last stats, at most the last 64

    @property
    def num_blocks_used(self) -> int:
        return self.num_blocks_total - self.num_free_blocks


class RoleChanged(msgspec.Struct, tag="role_changed", frozen=True):
    """The answer to SetRole: the role the engine plays now, or why it cannot change."""

    engine_id: str
    role: str
    error: str = ""
    # a new decode instance's prompts that waited untouched, dropped there for the frontend to
    # place again (engine/core.py _release_unstarted), in queue order
    released: list[str] = []


class Released(msgspec.Struct, tag="released", frozen=True):
    """The answer to ReleaseUnstarted: the requests dropped, in queue order."""

    engine_id: str
    request_ids: list[str]


class Heartbeat(msgspec.Struct, tag="heartbeat", frozen=True):
    """Sent by the engine's output thread even during a long forward pass: 'still alive'."""

    engine_id: str


# ---- the coordinator <-> API processes (`serve --api-server-count N`, api_hub.py) --------------
# An API process renders and tokenizes, sends ApiSubmit, and gets the coordinator's events as
# token ids: it detokenizes them and finds stop strings itself (then it sends ApiAbort "stop").

class ApiProcessConfig(msgspec.Struct, frozen=True):
    """What an API process is started with, on its stdin (not a socket): its index, the
    coordinator's address, the port to share, and serve's parsed flags as they are."""

    index: int
    hub_address: str
    parent_pid: int
    port: int
    settings: dict[str, str | int | float | bool | list | None]


class ApiHello(msgspec.Struct, tag="api_hello", frozen=True):
    """An API process listens on the shared port: the coordinator may count it as ready."""

    index: int
    pid: int


class ApiSubmit(msgspec.Struct, tag="api_submit", frozen=True):
    request_id: str  # the API process's own id (unique there); the coordinator keys by (process, id)
    client_request_id: str
    prompt_token_ids: list[int]
    params: WireSamplingParams
    priority: int = 0
    slo_class: str = ""  # the request's SLO class, for the adaptive mix's demand reading ("" : none)


class ApiAbort(msgspec.Struct, tag="api_abort", frozen=True):
    request_id: str
    reason: str = "abort"  # "abort": the client left; "stop": the API process found a stop string


class ApiForward(msgspec.Struct, tag="api_forward", frozen=True):
    """An HTTP request for a route the coordinator owns (/admin/..., /metrics), already past the
    API process's guards; answered with ApiForwardReply."""

    forward_id: int
    method: str
    path: str
    query: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes


class ApiInstance(msgspec.Struct, frozen=True):
    hello: EngineHello
    alive: bool


class ApiInstances(msgspec.Struct, tag="api_instances", frozen=True):
    """The instances as the coordinator sees them (sent on hello and a few times a second): what
    an API process checks model names, context lengths and /health against."""

    instances: list[ApiInstance]


class ApiSubmitted(msgspec.Struct, tag="api_submitted", frozen=True):
    """The answer to ApiSubmit: accepted (status 0) or the OpenAI error to return."""

    request_id: str
    status: int = 0
    message: str = ""
    error_type: str = ""
    param: str | None = None
    code: str | None = None
    retry_after_s: int | None = None


class ApiEvent(msgspec.Struct, frozen=True, array_like=True):
    """coordinator.request_state.TokenEvent on its way to an API process, which makes the text."""

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    num_completion_tokens: int
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    rejected: bool = False
    kv_transfer: KVTransferReport | None = None
    num_retries: int = 0
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None
    num_cached_tokens: int = 0
    placement: dict | None = None


class ApiEvents(msgspec.Struct, tag="api_events", frozen=True):
    events: list[ApiEvent]


class ApiForwardReply(msgspec.Struct, tag="api_forward_reply", frozen=True):
    forward_id: int
    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes


ToCoordinator = ApiHello | ApiSubmit | ApiAbort | ApiForward
FromCoordinator = ApiInstances | ApiSubmitted | ApiEvents | ApiForwardReply


ToEngine = (GenerateRequest | AbortRequests | SetRole | SetChunkTokens | SetStreamCap | Shutdown | ResendHello
            | ReleaseUnstarted)
FromEngine = EngineHello | StepOutputs | EngineStats | RoleChanged | Released | Heartbeat


def encode_engine_config(config: EngineConfig) -> bytes:
    return msgspec.msgpack.encode(config)


def decode_engine_config(payload: bytes) -> EngineConfig:
    """The settings `serve` built for this engine; re-checked on the way in (__post_init__)."""
    from splitserve.config import EngineConfig

    return msgspec.msgpack.decode(payload, type=EngineConfig)


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
