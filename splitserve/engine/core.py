"""The engine: one loop of schedule -> run model -> update state -> report outputs.

Single-threaded and in-process. The engine process (engine/process.py) wraps it with socket
threads; the offline LLM class drives it directly. What the role changes (where a request's KV
comes from, what happens to its blocks when it ends) is the connector's business
(engine/connectors.py); nothing here asks which role this instance plays.
"""
from __future__ import annotations

import logging
import math
import time
from collections import deque

import msgspec
import torch

from splitserve import kernels
from splitserve.config import PRIORITY_BOUNDS, ROLES, EngineConfig, ModelConfig
from splitserve.devices import check_device, torch_dtype
from splitserve.engine.block_manager import BlockManager
from splitserve.engine.connectors import allocate_kv_cache, default_chunk_tokens, make_connector
from splitserve.engine.model_runner import ModelRunner
from splitserve.engine.request import Request, RequestOutput, RequestStatus
from splitserve.engine.scheduler import ScheduledBatch, Scheduler
from splitserve.engine.structured import GrammarBackend
from splitserve.protocol import EngineStats, StepSample
from splitserve.stepfeatures import step_shape
from splitserve.sampling import SamplingParams

log = logging.getLogger("splitserve.engine")

STEP_TIME_DECAY = 0.8  # weight of the past in the moving average of step times
# Step samples kept between two stats (sent every 0.25 s at most): a 4 ms step on a tiny model
# fills it, and the newest are the ones worth sending.
MAX_STEP_SAMPLES = 64


class EngineCore:
    def __init__(self, config: EngineConfig, loaded=None, kv_network=None, clock=time.monotonic):
        """clock: what stamps a request's arrival (the priority policy's tie-break); a test that
        steps the engine on virtual time passes its own."""
        self.config = config
        self._clock = clock
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        check_device(config.device)  # before any weight is read: one clear line if there is no such device
        if config.kernels == "off":
            kernels.switch_off()  # before the loader asks whether the 4-bit kernels can run
        dtype = torch_dtype(config.dtype)
        if loaded is None:
            from splitserve.models.loader import load_model
            loaded = load_model(config.model, device=config.device, dtype=dtype, weight_format=config.weight_format)
        # Keep the tokenizer, not `loaded`: the runner holds its own fused copies of the
        # weights, and the caller's dict can be freed once it lets go of it.
        self.tokenizer = loaded.tokenizer
        self.model_name = loaded.name
        self.model_config: ModelConfig = loaded.config
        self._pool_handle = None

        def allocate(shape, dtype):
            pool, self._pool_handle = allocate_kv_cache(config, shape, dtype)
            return pool

        self.runner = ModelRunner(self.model_config, loaded.weights, config.cache, config.device, dtype=dtype,
                                  allocate_pool=allocate)
        self.kernel_rows = self._set_kernel_rows(config.kernel_rows)
        self.block_manager = BlockManager(self.runner.num_blocks, config.cache.block_size,
                                          config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.block_manager)
        self.scheduler.clock = self._clock
        self._kv_network = kv_network
        self.chunk_tokens: int | None = None  # set live (set_chunk_tokens); None: each role's own
        self.connector = self._make_connector(config.role)
        self.pending_role: str | None = None
        self.num_role_changes = 0
        self.released: list[str] = []  # prompts handed back by the last swap to decode (try_swap_role)
        self.requests: dict[str, Request] = {}
        self.grammars = GrammarBackend(self.tokenizer, self.model_config.vocab_size, self.model_config.eos_token_ids)
        self.generator = torch.Generator(device=config.device).manual_seed(config.seed)
        self.num_steps = 0
        self.step_seconds = 0.0  # moving average of recent steps that ran the model
        self.step_tokens = 0.0  # ... and of the tokens they carried
        self._step_samples: deque[StepSample] = deque(maxlen=MAX_STEP_SAMPLES)  # since the last stats()

    def _set_kernel_rows(self, rows: int | None) -> dict[str, int]:
        """Where each GGUF block matrix shape leaves the C++ kernel for dequantize + F.linear:
        measured here (None) or as told. {"q4_1 NxK": rows}; empty for an fp32 model."""
        from splitserve.models.gguf_blocks import calibrate_kernel_rows, set_kernel_rows

        matrices = self.runner.model.block_matrices()
        if not matrices:
            return {}
        if rows is None:
            start = time.perf_counter()
            chosen = calibrate_kernel_rows(matrices)
            log.info("GGUF kernel rows measured in %.2f s: %s", time.perf_counter() - start,
                     ", ".join(f"{fmt} {n}x{k}: {r}" for (fmt, n, k), r in chosen.items()) or "no kernels here")
        else:
            set_kernel_rows(matrices, rows)
        return {f"{w.fmt} {w.shape[0]}x{w.shape[1]}": w.kernel_rows for w in matrices}

    def _make_connector(self, role: str):
        shm_name = self._pool_handle.name if self._pool_handle is not None else ""
        connector = make_connector(role, self.config, self.runner.kv_cache, self.block_manager, shm_name,
                                   self._kv_network, self.scheduler.make_room_for_kv)
        connector.chunk_tokens = self._role_chunk_tokens(role)
        self.scheduler.prompt_tokens_per_step = connector.prompt_tokens_per_step(self.scheduler.has_streams())
        return connector

    def set_max_streams(self, streams: int | None) -> None:
        """The streams this instance may hold from now on, under any role (Scheduler.max_streams);
        None: max_num_seqs alone. Running streams are never evicted by it. ValueError if not positive."""
        self.scheduler.max_streams = _positive_or_none(streams, "max streams")

    def set_chunk_tokens(self, tokens: int | None) -> None:
        """The prompt tokens a step may carry beside streams that answer here, from now on and
        under any later colocated or decode role; None: each role's own (its config). A prefill
        role keeps its own budget beside the streams it carried over (_role_chunk_tokens).
        ValueError if not positive."""
        self.chunk_tokens = _positive_or_none(tokens, "chunk tokens")
        self.connector.chunk_tokens = self._role_chunk_tokens(self.connector.role)

    def _role_chunk_tokens(self, role: str) -> int | None:
        """A role's prompt tokens per step beside streams: the live knob's where it is set, except
        on a prefill instance. There the streams are only those carried over from an earlier role,
        a transient, while its prompts are every request's first token: the mix controller judges
        a move to prefill with the carried streams stepping at that role's own budget
        (MixController.carry_chunk_tokens), and the knob, which it sets for the decode and
        colocated instances' pauses, would halve the instance's prompt rate while they last
        (demand_rotation, session 29 on an AMX Xeon: at the knob's 32 tokens a 1,311-token summary
        took 41 steps beside 8-13 carried answers, and 7 requests queued behind it waited 4.4-8.9 s
        for a first token against a 4 s target)."""
        default = default_chunk_tokens(role, self.config)
        return default if role == "prefill" or self.chunk_tokens is None else self.chunk_tokens

    @property
    def role(self) -> str:
        return self.connector.role

    def change_role(self, role: str) -> None:
        """Asks for a new connector; it takes over once the old one has nothing in flight
        (try_swap_role). New requests should stop coming before this is called. ValueError if
        this instance can never play `role`."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        if role != "colocated" and self.config.kv_transfer is None:
            raise ValueError(f"this instance was started without KV transfer settings, so it cannot become "
                             f"{role}; start it with --kv-transport shm|tcp")
        self.pending_role = None if role == self.role else role

    def try_swap_role(self) -> bool:
        """Swaps the connector if a change is pending and the old one is idle; True if it did."""
        if self.pending_role is None or self.connector.has_unfinished():
            return False
        self.released = []
        role, self.pending_role = self.pending_role, None
        try:
            new = self._make_connector(role)
        except (OSError, ValueError) as e:  # e.g. a fixed --kv-port already taken
            raise ValueError(f"cannot become {role}: {e}") from None
        old = self.connector
        old.close()
        self.connector = new
        self.num_role_changes += 1
        if role == "decode" and old.role != "decode":
            self.released = self.release_unstarted()
        log.info("engine %s: role %s -> %s%s", self.config.instance_id, old.role, new.role,
                 f"; {len(self.released)} unstarted prompt(s) handed back" if self.released else "")
        return True

    def release_unstarted(self, request_ids: set[str] | None = None) -> list[str]:
        """Drops the prompts still waiting untouched (of `request_ids`, or all), for the frontend to
        place again; ids in queue order. A new decode instance keeps what it started (running
        streams, prompts partly prefilled) and hands back the rest: left here, they were prefilled
        in the decode role's small chunks beside every stream, and the short prompts the router
        then sent here waited behind them (demand_rotation_overload_x2, session 18: writers'
        20-120-token prompts met a 9-33 s TTFT behind retrieval prompts kept from the colocated
        role). A prefill instance releases the prompts planned onto a decode instance that is
        leaving its role (ReleaseUnstarted)."""
        out = []
        for request in list(self.scheduler.waiting):
            if request_ids is not None and request.request_id not in request_ids:
                continue
            if (request.num_computed_tokens == 0 and not request.output_token_ids
                    and request.num_preemptions == 0):
                self.abort_request(request.request_id)  # the connector forgets it too (a prefill one tracks it)
                out.append(request.request_id)
        return out

    @property
    def max_model_len(self) -> int:
        return self.model_config.max_position_embeddings

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError if the request can never run here; touches no state."""
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("prompt is empty: give at least one token")
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_token_ids
                    if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab})")
        if n + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"this model's maximum context length is {self.max_model_len} tokens, but the prompt "
                f"has {n} tokens and max_tokens is {params.max_tokens}; shorten the prompt or lower max_tokens")
        bm = self.block_manager
        if bm.blocks_needed(n + params.max_tokens) > bm.num_blocks:
            raise ValueError(
                f"prompt ({n} tokens) plus max_tokens ({params.max_tokens}) needs "
                f"{bm.blocks_needed(n + params.max_tokens)} KV blocks but the whole cache has "
                f"{bm.num_blocks}; raise kv_cache_memory or shorten the request")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    kv_descriptor=None, first_token_ids: list[int] | None = None, priority: int = 0,
                    ttft_due_in_s: float | None = None) -> None:
        """kv_descriptor: the prompt's KV waits on a prefill instance, which already produced
        first_token_ids; the connector pulls the KV and the request continues from there.
        priority: lower first under the priority scheduling policy (either stage).
        ttft_due_in_s: its first token is due that many seconds from now (<= 0: late already);
        under fcfs a late prompt waits behind those that can still meet theirs."""
        if not isinstance(params, SamplingParams):
            raise TypeError("params must be a SamplingParams")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if kv_descriptor is not None and not first_token_ids and not kv_descriptor.streamed:
            raise ValueError("a KV descriptor comes with the first token the prefill instance produced "
                             "(only a streamed one, from kv send mode overlap, brings it at the end)")
        prompt_token_ids = list(prompt_token_ids)
        self.validate(prompt_token_ids, params)
        if isinstance(priority, bool) or not isinstance(priority, int) or not (
                PRIORITY_BOUNDS[0] <= priority <= PRIORITY_BOUNDS[1]):
            raise ValueError(f"priority must be an integer in {PRIORITY_BOUNDS[0]}..{PRIORITY_BOUNDS[1]}, "
                             f"got {priority!r}")
        if ttft_due_in_s is not None and (isinstance(ttft_due_in_s, bool) or not isinstance(ttft_due_in_s, (int, float))
                                          or not math.isfinite(ttft_due_in_s)):
            raise ValueError(f"ttft_due_in_s must be a finite number of seconds, got {ttft_due_in_s!r}")
        request = Request(request_id, prompt_token_ids, params, arrival_time=self._clock(), priority=priority,
                          eos_token_ids=self.model_config.eos_token_ids,
                          max_model_len=self.max_model_len)
        if ttft_due_in_s is not None:
            request.ttft_deadline = request.arrival_time + ttft_due_in_s
        if params.seed is not None:
            request.generator = torch.Generator(device=self.config.device).manual_seed(params.seed)
        if kv_descriptor is not None:
            request.output_token_ids = list(first_token_ids or [])
        n = params.answer_prefix_len
        self.grammars.attach(request, (prompt_token_ids[-n:] if n else []) + request.output_token_ids)
        if kv_descriptor is not None and self.role == "colocated" and request.output_token_ids:
            # handed over while this instance swapped from decode, before the frontend heard of it:
            # prompt + first token are prefilled here (the prefill instance's lease lapses)
            request.kv_outcome, kv_descriptor = "recomputed", None
        if not self.connector.on_add(request, kv_descriptor):
            self.scheduler.add(request)
        self.requests[request_id] = request

    def abort_request(self, request_id: str) -> bool:
        taken = self.connector.abort(request_id)  # held for a handover, or waiting for its KV
        request = self.requests.pop(request_id, None)
        if request is None:
            return taken
        if not taken:
            self.scheduler.remove(request)
        request.status = RequestStatus.FINISHED_ABORTED
        return True

    def abort_all(self) -> None:
        for request_id in list(self.requests) + self.connector.held_request_ids():
            self.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self.connector.has_unfinished()

    def _fail(self, request: Request, error: str) -> RequestOutput:
        """Ends one request with an error, wherever it is, and frees what it holds: one bad request
        must never take the engine (and every other request) down with it."""
        log.exception("engine %s: request %s failed: %s", self.config.instance_id, request.request_id, error)
        self.requests.pop(request.request_id, None)
        if not self.connector.abort(request.request_id):
            self.scheduler.remove(request)
        request.status = RequestStatus.FINISHED_ERROR
        return RequestOutput(request.request_id, [], finished=True, finish_reason="error",
                             num_prompt_tokens=request.num_prompt_tokens, error=f"engine error: {error}")

    def _poll_connector(self) -> list[RequestOutput]:
        arrivals = self.connector.poll()
        for request in arrivals.decode:
            if request.request_id in self.requests:  # else aborted meanwhile
                self.scheduler.add_prefilled(request)
        for request in arrivals.prefill:
            if request.request_id in self.requests:
                self.scheduler.add(request)
        for out in arrivals.failed:
            self.requests.pop(out.request_id, None)
        return arrivals.failed

    def step(self) -> list[RequestOutput]:
        outputs = self._poll_connector()
        self.scheduler.prompt_tokens_per_step = self.connector.prompt_tokens_per_step(self.scheduler.has_streams())
        batch = self.scheduler.schedule()
        if not batch:
            return outputs
        shape = step_shape(batch)  # before the run moves num_computed_tokens on
        started, cpu_started = time.perf_counter(), time.thread_time()
        try:
            sampled = self.runner.execute(batch, self.generator)
            self.runner.synchronize()  # a prompt chunk that samples nothing leaves its kernels queued
        except Exception as e:  # noqa: BLE001 - the batch fails, the engine lives on
            requests = batch.decodes + [r for r, _ in batch.prefills]
            return outputs + [self._fail(r, f"{type(e).__name__}: {e}") for r in requests]
        self._observe_step(time.perf_counter() - started, batch.num_tokens, shape, time.thread_time() - cpu_started)
        finished = set(self.scheduler.update(batch, sampled))
        self.num_steps += 1
        outputs += self._prefill_progress(batch, sampled)
        for request, token in sampled.items():
            done = request in finished
            out = RequestOutput(
                request.request_id, [token], finished=done,
                finish_reason=request.status.value if done else None,
                num_prompt_tokens=request.num_prompt_tokens,
                num_cached_tokens=request.num_cached_tokens)
            if request in self.runner.last_logprobs:
                out.logprobs = [self.runner.last_logprobs[request]]
            if request.params.prompt_logprobs is not None and request.num_output_tokens == 1:
                out.prompt_logprobs = request.prompt_logprobs
            if done:
                try:
                    out.kv_descriptor = self._finish(request)
                except Exception as e:  # noqa: BLE001
                    outputs.append(self._fail(request, f"{type(e).__name__}: {e}"))
                    continue
                out.kv_transfer, out.kv_outcome = request.kv_transfer, request.kv_outcome
            outputs.append(out)
        return outputs

    def _prefill_progress(self, batch, sampled: dict) -> list[RequestOutput]:
        """Prompts still being prefilled (no token this step): the connector may hand one over
        now (overlap mode)."""
        outputs = []
        for request, _ in batch.prefills:
            if request in sampled or request.request_id not in self.requests:
                continue
            descriptor = self.connector.on_prefill_progress(request)
            if descriptor is not None:
                outputs.append(RequestOutput(request.request_id, [], num_prompt_tokens=request.num_prompt_tokens,
                                             kv_descriptor=descriptor))
        return outputs

    def _finish(self, request: Request):
        """The connector decides whether the blocks stay (a handover) or go."""
        keep_blocks, kv_params = self.connector.on_finished(request)
        if not keep_blocks:
            self.block_manager.free(request)
        self.requests.pop(request.request_id, None)
        return kv_params

    def _observe_step(self, seconds: float, num_tokens: int, shape: tuple[int, float, int, int],
                      cpu_seconds: float = 0.0) -> None:
        self._step_samples.append(StepSample(*shape, seconds, cpu_seconds=cpu_seconds))
        if self.step_seconds == 0.0:
            self.step_seconds, self.step_tokens = seconds, float(num_tokens)
        else:
            self.step_seconds = STEP_TIME_DECAY * self.step_seconds + (1 - STEP_TIME_DECAY) * seconds
            self.step_tokens = STEP_TIME_DECAY * self.step_tokens + (1 - STEP_TIME_DECAY) * num_tokens

    @property
    def step_samples_full(self) -> bool:
        """As many step samples wait as one stats message carries: send stats now or lose the oldest."""
        return len(self._step_samples) >= MAX_STEP_SAMPLES

    def note_loop_seconds(self, steps_before: int, seconds: float) -> None:
        """The engine loop's turn that ran exactly one step (num_steps was `steps_before` when it
        began) took `seconds` in all: kept on that step's sample, for comparing a live engine's steps
        with a profile's (which times EngineCore.step alone)."""
        if self.num_steps == steps_before + 1 and self._step_samples:
            self._step_samples[-1] = msgspec.structs.replace(self._step_samples[-1], loop_seconds=seconds)

    def close(self) -> None:
        """Stop KV-transfer threads and release a shared-memory pool."""
        self.connector.close()
        if self._pool_handle is not None:
            self._pool_handle.close()

    def stats(self) -> EngineStats:
        """The engine's counters now, with the step samples gathered since the last call (taken:
        each sample goes out once)."""
        bm, sched = self.block_manager, self.scheduler
        samples = list(self._step_samples)
        self._step_samples.clear()
        return EngineStats(
            self.config.instance_id, self.role, len(sched.waiting), len(sched.running), bm.num_blocks,
            bm.num_free_blocks, prefix_cache_queries=bm.num_prefix_queries,
            prefix_cache_hits=bm.num_prefix_hits, num_preemptions=sched.num_preemptions,
            num_steps=self.num_steps, kv=self.connector.stats(), block_size=bm.block_size,
            num_queued_prompt_tokens=sched.num_queued_prompt_tokens, step_seconds=self.step_seconds,
            step_tokens=self.step_tokens,
            num_role_changes=self.num_role_changes, step_samples=samples)


def _positive_or_none(value, what: str) -> int | None:
    """A live knob's value (set_chunk_tokens, set_max_streams): a positive whole number or None."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        raise ValueError(f"{what} must be a positive whole number or None, got {value!r}")
    return value
