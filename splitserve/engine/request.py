"""A request as the engine sees it: token ids in, token ids out.

Lifecycle (colocated):
    WAITING -> RUNNING -> FINISHED_*            (preemption sends RUNNING back to WAITING)
Disaggregated (the connector decides which edges exist, engine/connectors.py):
    remote_decode: WAITING -> RUNNING -> FINISHED_PREFILL_DONE  (blocks kept for the handover)
    KV from a peer: WAITING_FOR_KV -> RUNNING -> FINISHED_*     (blocks filled from a peer)
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from splitserve.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_KV = "waiting_for_kv"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"
    FINISHED_PREFILL_DONE = "prefill_done"

    @property
    def finished(self) -> bool:
        return self.name.startswith("FINISHED")


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = 0.0
    priority: int = 0  # lower first under the priority scheduling policy
    ttft_deadline: float | None = None  # engine clock time its first token is due by (None: none)
    demoted: bool = False  # queued behind the prompts that can still meet their deadlines (late)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # chained SHA-256 of full blocks
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_cached_tokens: int = 0  # of those, how many came from the prefix cache
    num_preemptions: int = 0
    generator: object | None = None  # torch.Generator when params.seed is set
    eos_token_ids: tuple[int, ...] = ()
    max_model_len: int = 1 << 30
    remote_decode: bool = False  # stops after its first token; a decode instance continues it
    kv_transfer: object | None = None  # TransferRecord of the KV it received from a prefill instance
    kv_outcome: str | None = None  # that transfer's end for the client: ok | recomputed | failed
    grammar: object | None = None  # RequestGrammar when params.json_schema or params.grammar is set
    # params.prompt_logprobs: [protocol.TokenLogprobs] of prompt tokens 1, 2, ... scored so far
    prompt_logprobs: list = field(default_factory=list)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_id(self, position: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[position] if position < n else self.output_token_ids[position - n]

    @property
    def is_prefilling(self) -> bool:
        # The last token of the sequence is fed to produce the next one; everything
        # before it must be in the cache for this step to be a decode step.
        return self.num_computed_tokens < self.num_tokens - 1


@dataclass(slots=True)
class RequestOutput:
    """What one engine step reports for one request (only requests with news appear)."""

    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | "prefill_done"
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    kv_descriptor: object | None = None  # "prefill_done": where a decode instance can pull the KV
    kv_transfer: object | None = None  # the TransferRecord of the KV this request received
    kv_outcome: str | None = None  # ok | recomputed | failed, decided by the decode connector
    logprobs: list | None = None  # [protocol.TokenLogprobs] for new_token_ids, when asked
    prompt_logprobs: list | None = None  # [protocol.TokenLogprobs] of prompt tokens 1.., with the first token
