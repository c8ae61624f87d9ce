"""The dispatcher: where a request goes, its handover between stages, and its second chances.

    submit --> _dispatch: router.pick --> GenerateRequest --link--> P (or a colocated instance)
    P --> TokenOutput(first token, "prefill_done", kv_descriptor) --> the client gets the token now
      --> _hand_over --> D: GenerateRequest(prompt, kv_descriptor, first_token_ids)  (D pulls the KV)
    D --> TokenOutput(more tokens ..., the final one with the KV report) --> the client

`_dispatch` is the one path that sends a request: the first time, a retry (its engine died before
any token: sent again as is), a resume (its engine died mid-stream: prompt + the tokens so far
are prefilled elsewhere and generation continues where it stopped, so a greedy stream goes on
with the same tokens), and a request parked while an instance changed its role. Each dispatch
gets a fresh internal request id (whatever X-Request-Id the client sent), so a stale engine can
never collide with the new attempt, and nothing is registered with the router unless the send
went out.

An abort (client gone, stop string, even on the first token) goes to every instance that may
hold the request's blocks: P while they are leased, D while it waits for or decodes the KV.
Everything runs on the frontend's event loop (one thread): request state needs no locks.
"""
from __future__ import annotations

import itertools
import logging
import time

import msgspec

from splitserve.coordinator.disagg_policy import DisaggPolicy
from splitserve.coordinator.engine_link import EngineLink
from splitserve.coordinator.metrics import FrontendMetrics
from splitserve.coordinator.output_processor import OutputProcessor
from splitserve.coordinator.request_state import EventSink, RequestState, TokenStream
from splitserve.coordinator.role_change import RoleChanger
from splitserve.coordinator.router import NoInstanceAvailable, RoutableRequest, RoutePlan, Router, prefix_key
from splitserve.protocol import (AbortRequests, EngineStats, GenerateRequest, Released, ReleaseUnstarted, RoleChanged,
                                 StepOutputs, WireSamplingParams)
from splitserve.sampling import SamplingParams

log = logging.getLogger(__name__)


def wire_params(params: SamplingParams) -> WireSamplingParams:
    return WireSamplingParams(
        max_tokens=params.max_tokens, temperature=float(params.temperature), top_p=float(params.top_p),
        top_k=params.top_k, seed=params.seed, min_tokens=params.min_tokens,
        stop_token_ids=list(params.stop_token_ids), ignore_eos=params.ignore_eos, logprobs=params.logprobs,
        prompt_logprobs=params.prompt_logprobs, json_schema=params.json_schema, grammar=params.grammar)


class Dispatcher:
    def __init__(self, link: EngineLink, router: Router, outputs: OutputProcessor, metrics: FrontendMetrics,
                 max_queued_requests: int = 256, retry_on_engine_failure: int = 1,
                 disagg_policy: DisaggPolicy | None = None) -> None:
        self.link, self.router, self.outputs, self.metrics = link, router, outputs, metrics
        self.disagg_policy = disagg_policy  # local or remote prefill of a disaggregated plan
        self.max_queued_requests = max_queued_requests
        self.retry_on_engine_failure = retry_on_engine_failure
        self.requests: dict[str, RequestState] = {}  # by internal request id
        self.parked: list[RequestState] = []  # no instance could take them while roles were changing
        # The mix controller's stream cap, per decode instance (Coordinator.set_stream_caps). A stream
        # handed over has begun its answer, so the engine never holds it (Scheduler.max_streams): a
        # separated plan whose decode instance is at its cap waits here instead, before its prefill,
        # the most urgent first (demand_rotation_overload_x2, session 28: in 1 prefill + 1 decode
        # through the writing surge the prefill instance handed over every prompt it finished, the
        # decode instance stepped 33-36 streams and more at 1-2 s a token, and pauses reached 48 s).
        self.stream_caps: dict[str, int] = {}
        self.held: list[RequestState] = []
        self.roles = RoleChanger(link, router, metrics, settled=self.dispatch_parked, num_inbound=self._num_inbound,
                                 release_inbound=self._release_inbound)
        self._ids = itertools.count()
        self.refusing: str | None = None  # set when the coordinator restarts: new requests get 503 with this


    # ---- requests ----------------------------------------------------------------------

    def submit(self, client_request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               priority: int = 0, events: EventSink | None = None, ttft_target_s: float | None = None) -> TokenStream:
        """Routes and sends one request. NoInstanceAvailable when no instance can take it;
        ValueError when a parameter cannot be sent. Either way nothing stays registered.
        `events`: a request of an API process (entrypoints/api_hub.py): its events go to
        events.put_nowait instead of the returned stream's queue. ttft_target_s: its first token
        is due that many seconds from now (the engine serves late prompts last)."""
        if self.refusing is not None:
            raise NoInstanceAvailable(self.refusing, retry_after_s=5, status=503)
        state = RequestState("", client_request_id, list(prompt_token_ids), wire_params(params), priority=priority)
        if ttft_target_s is not None:
            state.ttft_due = state.arrival + ttft_target_s
        if events is not None:
            state.queue = events
        self._dispatch(state)
        return TokenStream(state, self.abort)

    def _dispatch(self, state: RequestState) -> None:
        """Sends the request (prompt + any tokens it already produced) to the instance(s) the
        router picks; parks it if none can take it only because a role change is under way."""
        prompt = state.prompt_token_ids + state.token_ids
        n = len(state.token_ids)
        # a resumed request's prompt logprobs reached the client with its first token already
        wire = msgspec.structs.replace(state.wire_params, max_tokens=state.wire_params.max_tokens - n,
                                       min_tokens=max(0, state.wire_params.min_tokens - n), answer_prefix_len=n,
                                       prompt_logprobs=None if n else state.wire_params.prompt_logprobs)
        request_id = f"{state.client_request_id[:64]}.{next(self._ids)}"
        try:
            due = state.ttft_due - time.monotonic() if state.ttft_due is not None and not n else None
            payload = self.link.encode(GenerateRequest(request_id, prompt, wire, priority=state.priority,
                                                       ttft_due_in_s=due))
        except (OverflowError, msgspec.EncodeError) as e:
            raise ValueError(f"a sampling parameter is out of range: {e}") from None
        routable = RoutableRequest(request_id, len(prompt), wire.max_tokens, prefix_key(prompt), prompt)
        try:
            plan = self.router.pick(routable)
            if plan.prefill_instance_id is not None and not n and self._at_cap(plan.instance_id):
                self._hold(state, request_id, plan.instance_id)
                return
            if self.disagg_policy is not None:
                plan, placement = self.disagg_policy.place(plan, routable, self.link.instances, self.router)
                state.placement = placement.report() if placement is not None else None
        except NoInstanceAvailable:
            if not self.roles.changing():
                raise
            state.request_id, state.instance_id = request_id, None
            state.prefill_instance_id = state.decode_instance_id = None
            self.parked.append(state)
            return
        self.link.send_encoded(plan.prefill_instance_id or plan.instance_id, payload)
        # Only now, with the request on its way (and no await in between: no output can come
        # before), does it take an admission slot.
        self.router.on_start(plan, routable)
        state.request_id, state.sent_prompt, state.sent_params = request_id, prompt, wire
        state.streamed_to, state.held_outputs = None, []
        self._set_plan(state, plan)
        self.requests[request_id] = state

    # ---- the stream cap of a separated mix ---------------------------------------------------

    def set_stream_cap(self, engine_id: str, streams: int | None) -> None:
        """An instance's stream cap (None or 0: none), read while it is a separated plan's decode
        instance; requests held for it may go now."""
        if streams:
            self.stream_caps[engine_id] = streams
        else:
            self.stream_caps.pop(engine_id, None)
        self.release_held()

    def _streams_on(self, decode_id: str) -> int:
        """Requests answering on `decode_id` or planned onto it (prefilling elsewhere, or there): the
        router admits a separated plan on its decode instance from the start (Router.on_start)."""
        load = self.router.instances.get(decode_id)
        return load.num_requests if load is not None else 0

    def _at_cap(self, decode_id: str) -> bool:
        cap = self.stream_caps.get(decode_id)
        return cap is not None and self._streams_on(decode_id) >= cap

    def _hold(self, state: RequestState, request_id: str, decode_id: str) -> None:
        if len(self.held) >= self.max_queued_requests:
            raise NoInstanceAvailable(f"decode instance {decode_id} is at its stream cap and "
                                      f"{len(self.held)} requests already wait for room")
        state.request_id, state.instance_id = request_id, None
        state.prefill_instance_id = state.decode_instance_id = None
        self.held.append(state)

    def release_held(self) -> None:
        """Sends held requests, the most urgent first, until one finds its decode instance still at
        its cap (the rest would too: the router picks the least loaded); called as streams end, as
        caps change and on every tick."""
        if not self.held:
            return
        held, self.held = sorted(self.held, key=lambda s: (s.priority, s.arrival)), []
        for i, state in enumerate(held):
            try:
                self._dispatch(state)
            except (NoInstanceAvailable, ValueError) as e:
                self._end(state, "error", f"no engine instance could take this request: {e}")
                continue
            if self.held:  # held again: its decode instance is still full
                self.held.extend(held[i + 1:])
                return

    def _inbound(self, decode_id: str) -> list[RequestState]:
        """Requests planned to be handed over to decode instance `decode_id`, still prefilling elsewhere."""
        return [s for s in self.requests.values() if s.decode_instance_id == decode_id != s.instance_id]

    def _num_inbound(self, decode_id: str) -> int:
        return len(self._inbound(decode_id))

    def _release_inbound(self, decode_id: str) -> None:
        """Decode instance `decode_id` is leaving its role: the prefill instances are asked to drop
        the prompts planned onto it that they have not begun (answered with Released, placed again
        by _take_back once the change settles), so the change waits only for those already
        prefilling (demand_rotation_overload_x2, session 19: a decode -> colocated change waited
        out its 60 s timeout behind the prefill instance's queue)."""
        by_prefill: dict[str, list[str]] = {}
        for s in self._inbound(decode_id):
            if s.streamed_to is None and not s.token_ids:
                by_prefill.setdefault(s.instance_id, []).append(s.request_id)
        for prefill_id, request_ids in by_prefill.items():
            inst = self.link.instances.get(prefill_id)
            if inst is not None and inst.alive:
                self.link.send(prefill_id, ReleaseUnstarted(request_ids))

    @staticmethod
    def _set_plan(state: RequestState, plan: RoutePlan) -> None:
        state.instance_id = plan.prefill_instance_id or plan.instance_id
        state.prefill_instance_id = plan.prefill_instance_id
        state.decode_instance_id = plan.instance_id if plan.prefill_instance_id is not None else None

    def dispatch_parked(self) -> None:
        # the most urgent first (lower priority value, then arrival), as an engine admits them
        parked, self.parked = sorted(self.parked, key=lambda s: (s.priority, s.arrival)), []
        for state in parked:
            try:
                self._dispatch(state)
            except (NoInstanceAvailable, ValueError) as e:
                self._end(state, "error", f"no engine instance could take this request: {e}")
        self.release_held()  # a settled role change may have opened room (or left no separated plan)

    def abort(self, state: RequestState, reason: str = "abort") -> None:
        """reason "stop": the API found a stop string in the text (counted as a stop, not an abort)."""
        if state in self.parked:
            self.parked.remove(state)
        elif state in self.held:
            self.held.remove(state)
        elif self.requests.pop(state.request_id, None) is None:
            return
        self._release(state)
        if reason != "abort":
            self._count_finished(state, reason)
        else:
            self.metrics.requests.labels("abort").inc()
            if state.token_ids:
                self.metrics.aborted_tokens.labels("prompt").inc(state.num_prompt_tokens)
                self.metrics.aborted_tokens.labels("generated").inc(state.num_completion_tokens)
        # Wakes a consumer still waiting on this request (the disconnect watcher aborts it).
        state.queue.put_nowait(self.outputs.finish_event(state, "abort"))

    def stop_taking(self, refusal: str, failure: str) -> int:
        """The coordinator restarts (entrypoints/coordinator_restart.py): new requests are refused
        with `refusal` (503), every one in flight or parked ends now with the error `failure`, and
        its engines are told to drop it (freeing its blocks). -> how many were ended."""
        self.refusing = refusal
        states = list(self.requests.values()) + self.parked + self.held
        self.parked, self.held = [], []
        for state in states:
            self._end(state, "error", failure)
        return len(states)

    def _release(self, state: RequestState, abort: bool = True) -> None:
        """The request is over here: forget it in the router and, unless its engines finished it
        themselves, abort it on every instance that may hold it (an unknown id is a no-op
        there), so each frees its blocks."""
        for instance_id in state.holders():
            self.router.on_finish(instance_id, state.request_id)
            if self.disagg_policy is not None:
                self.disagg_policy.on_prefilled(instance_id, state.request_id)
            inst = self.link.instances.get(instance_id)
            if abort and inst is not None and inst.alive:
                self.link.send(instance_id, AbortRequests([state.request_id]))

    def _end(self, state: RequestState, reason: str, error: str | None = None) -> None:
        """Ends a request the engines no longer hold (or that never reached one) with an event."""
        self.requests.pop(state.request_id, None)
        self._release(state)
        self.metrics.requests.labels(reason).inc()
        state.queue.put_nowait(self.outputs.finish_event(state, reason, error))
        self.release_held()

    def _hand_over_early(self, state: RequestState, out) -> None:
        """kv send mode overlap: P finished the prompt's first chunk and offers a streamed
        descriptor. D gets the request now and pulls the blocks as P computes them; the first
        token reaches D at the end of that stream, and the client from P as usual."""
        if (state.stream_failed or state.decode_instance_id is None
                or not self.router.plays(state.decode_instance_id, "decode")):
            return  # P hands over at the end (the streamed descriptor then carries everything)
        state.streamed_to = state.decode_instance_id
        self.link.send(state.streamed_to, GenerateRequest(state.request_id, state.sent_prompt, state.sent_params,
                                                          out.kv_descriptor, [], priority=state.priority))

    @staticmethod
    def _stream_failed(out) -> bool:
        return out.finished and out.finish_reason == "error" and out.kv_transfer is not None and (
            out.kv_transfer.outcome == "failed")

    def _hand_over(self, state: RequestState, out) -> None:
        """P finished the prompt: D pulls its KV and continues after the first token. If D can no
        longer take it (dead, drained, no longer a decode instance), the KV is dropped and the request resumes
        by recomputing prompt + first token wherever the router sends it now."""
        prefill_id = state.instance_id
        self.router.on_finish(prefill_id, state.request_id)
        if state.streamed_to is not None:  # D has had it since the first chunk
            failed = any(self._stream_failed(o) for o in state.held_outputs)
            completed = out.kv_descriptor is not None and out.kv_descriptor.streamed  # else P gave the hold up
            if completed and not failed and self.router.still_decodes(state.streamed_to):
                state.instance_id = state.streamed_to  # _process delivers D's held outputs next
                return
            state.streamed_to, state.held_outputs, state.stream_failed = None, [], True
            self._redispatch(state, "the streamed KV handover failed")
            return
        # A decode instance changing its role still takes the streams planned onto it (parking
        # them for the change and recomputing prompt + first token stalled them for seconds).
        if not self.router.still_decodes(state.decode_instance_id):
            self._redispatch(state, f"decode instance {state.decode_instance_id} can no longer take it")
            return
        state.instance_id = state.decode_instance_id
        self.link.send(state.instance_id, GenerateRequest(state.request_id, state.sent_prompt, state.sent_params,
                                                          out.kv_descriptor, list(out.new_token_ids),
                                                          priority=state.priority))

    def _redispatch(self, state: RequestState, why: str) -> None:
        self.requests.pop(state.request_id, None)
        self._release(state)
        try:
            self._dispatch(state)
        except (NoInstanceAvailable, ValueError) as e:
            self.metrics.requests.labels("error").inc()
            state.queue.put_nowait(self.outputs.finish_event(state, "error", f"{why}, and {e}"))

    # ---- the only loop over engine outputs ---------------------------------------------

    def on_message(self, engine_id: str, message) -> None:
        if isinstance(message, StepOutputs):
            self._on_outputs(engine_id, message)
        elif isinstance(message, EngineStats):
            self.link.instances[engine_id].observe_stats(message)
            self.metrics.observe_stats(message)
            self.router.set_free_blocks(engine_id, message.num_free_blocks)
        elif isinstance(message, RoleChanged):
            self._take_back(engine_id, message.released)
            self.roles.on_role_changed(engine_id, message)
        elif isinstance(message, Released):
            self._take_back(engine_id, message.request_ids)

    def _take_back(self, engine_id: str, request_ids: list[str]) -> None:
        """Prompts an engine dropped untouched (engine/core.py release_unstarted: a new decode
        instance's queue, or a prefill instance's prompts planned onto a decode instance leaving
        its role) wait parked, in arrival order, and go out again once the change has settled,
        where the router and the disaggregation policy send them now."""
        taken = 0
        for request_id in request_ids:
            state = self.requests.get(request_id)
            if state is None or state.instance_id != engine_id or state.token_ids:
                continue  # ended meanwhile, or already moved on: nothing to place again
            self.requests.pop(request_id)
            self._release(state, abort=False)  # the engine dropped it already
            state.instance_id = state.prefill_instance_id = state.decode_instance_id = None
            self.parked.append(state)
            taken += 1
        if taken:
            log.warning("engine %s: %d unstarted prompt(s) handed back for a role change; placing them again",
                        engine_id, taken)
            self.metrics.handed_back.inc(taken)
            if not self.roles.changing():
                self.dispatch_parked()

    def _on_outputs(self, engine_id: str, message: StepOutputs) -> None:
        self._process(engine_id, message.outputs)

    def _process(self, engine_id: str, outputs: list) -> None:
        for out in outputs:
            state = self.requests.get(out.request_id)
            if state is not None and state.streamed_to == engine_id != state.instance_id:
                state.held_outputs.append(out)  # D ahead of P's first token (overlap mode)
                continue
            if state is None or state.instance_id != engine_id:
                continue  # aborted or stopped here while the engine was still stepping
            if out.kv_descriptor is not None and out.kv_descriptor.streamed and not out.new_token_ids:
                self._hand_over_early(state, out)
                continue
            if state.streamed_to == engine_id and self._stream_failed(out):
                state.streamed_to, state.stream_failed = None, True  # D lacks the first token: resume
                self._redispatch(state, "the streamed KV transfer failed")
                continue
            is_first = not state.token_ids
            if out.new_token_ids and state.num_cached_tokens is None:
                # counted where the prompt was prefilled: P's first token, or D's when it prefilled it
                state.num_cached_tokens = min(out.num_cached_tokens, state.num_prompt_tokens)
                self.metrics.cached_prompt_tokens.inc(state.num_cached_tokens)
            if out.new_token_ids and self.disagg_policy is not None:
                self.disagg_policy.on_prefilled(engine_id, state.request_id)
            processed = self.outputs.process(state, out)
            event = processed.event
            self.router.on_progress(engine_id, state.request_id, state.num_prompt_tokens if is_first else 0,
                                    len(out.new_token_ids))
            if event.finished:
                self.requests.pop(state.request_id, None)
                # An engine that ended the request itself holds nothing; otherwise (an error) every
                # holder is told to drop it.
                self._release(state, abort=not processed.engine_done)
                self._count_finished(state, "rejected" if out.rejected else event.finish_reason or "error")
                if self.held:
                    self.release_held()
            elif processed.handed_over:
                self._hand_over(state, out)
            state.queue.put_nowait(event)
            if state.held_outputs and state.instance_id == state.streamed_to:
                held, state.held_outputs = state.held_outputs, []
                self._process(state.instance_id, held)

    def _count_finished(self, state: RequestState, outcome: str) -> None:
        self.metrics.requests.labels(outcome).inc()
        self.metrics.prompt_tokens.inc(state.num_prompt_tokens)
        self.metrics.e2e.observe(time.monotonic() - state.arrival)

    # ---- instances coming and going ----------------------------------------------------

    def on_ready(self, engine_id: str, rejoined: bool) -> None:
        inst = self.link.instances[engine_id]
        self.router.add_instance(engine_id, inst.hello.role, inst.hello.max_num_seqs + self.max_queued_requests)
        self.metrics.set_alive(engine_id, inst.hello.role, True)
        if self.parked:
            self.dispatch_parked()

    def on_dead(self, engine_id: str, why: str) -> None:
        """Its requests go elsewhere: retried if no token reached the client, else resumed by
        recomputing prompt + tokens so far; failed when out of second chances."""
        inst = self.link.instances[engine_id]
        self.metrics.set_alive(engine_id, inst.hello.role, False)
        lost = self.router.mark_dead(engine_id)
        inst.lost_request_ids.update(lost)
        self.roles.on_dead(engine_id)  # a survivor may take over a role no one plays now
        for request_id in lost:
            state = self.requests.get(request_id)
            if state is None or state.instance_id != engine_id:
                continue  # it was only planned there (a decode instance to be): _hand_over re-routes
            if state.num_completion_tokens >= state.wire_params.max_tokens:
                self._end(state, "length")  # its last token arrived; only the finish was lost
                continue
            if state.num_retries + state.num_resumes >= self.retry_on_engine_failure:
                self._end(state, "error", f"engine instance {engine_id} died ({why}) while serving this request")
                continue
            if state.token_ids:
                state.num_resumes += 1
                self.metrics.resumes.inc()
                kind = f"resumed after {len(state.token_ids)} tokens"
            else:
                state.num_retries += 1
                self.metrics.retries.inc()
                kind = f"died before its first token; retry {state.num_retries}"
            self._redispatch(state, f"engine instance {engine_id} died ({why})")
            log.warning("request %s: engine %s %s on %s", state.client_request_id, engine_id, kind,
                        state.instance_id or "(parked)")

    def on_tick(self) -> None:
        """Drained instances leave once they hold nothing (a prefill one may still lend KV); held
        requests whose decode instance has room go (a stream may have ended on an abort)."""
        self.release_held()
        for engine_id, inst in list(self.link.instances.items()):
            load = self.router.instances.get(engine_id)
            if not inst.alive or load is None or not load.draining or load.num_requests:
                continue
            kv = inst.stats.kv if inst.stats is not None else None
            if kv is None or kv.num_held_blocks == 0:
                self.link.remove(engine_id, "drained by the admin API")
