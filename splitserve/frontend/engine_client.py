"""The frontend's side of the engine link: one ROUTER socket, and the only loop over outputs.

    submit() --router.pick--> GenerateRequest --ROUTER--> engine <id>/in
    engine <id>/out --StepOutputs--> _handle_outputs: derender + stop strings --> RequestStream

Disaggregated (the router names a prefill instance P and a decode instance D):

    submit --> P: GenerateRequest(prompt)
    P --> TokenOutput(first token, "prefill_done", kv_descriptor) --> the client gets the token now
      --> D: GenerateRequest(prompt, kv_descriptor, first_token_ids)   (D pulls the KV from P)
    D --> TokenOutput(more tokens ..., final one with kv_transfer) --> the client

An abort (client gone, stop string) goes to every instance that may hold the request: P (its
blocks may still be held for the handover) and D. The transfer's report ends up on the final
event, in the format the trial reads (docs/internals.md, "Trial <-> server").

Everything runs on the frontend's asyncio loop (one thread), so request state needs no
locks. A stop-string hit or a closed stream sends an abort to the engine at once, so the
engine frees the request's KV blocks. An engine that exits or goes silent is marked dead and
each of its requests ends with an error instead of hanging.
"""
from __future__ import annotations

import asyncio
import logging
import subprocess
import time

import msgspec
import zmq
import zmq.asyncio

from splitserve.frontend.metrics import FrontendMetrics
from splitserve.frontend.render import Renderer
from splitserve.frontend.request_state import (GenerationEvent, Instance, RequestState, RequestStream,
                                               trial_report)
from splitserve.frontend.router import NoInstanceAvailable, RoutableRequest, Router, prefix_key
from splitserve.frontend.security import EngineLinkSecurity
from splitserve.protocol import (AbortRequests, Codec, EngineHello, EngineStats, GenerateRequest, Heartbeat,
                                 PROTOCOL_VERSION, Shutdown, StepOutputs, ToEngine,
                                 TokenOutput, WireSamplingParams, socket_identity)
from splitserve.sampling import SamplingParams

log = logging.getLogger(__name__)


class EngineClient:
    def __init__(self, renderer: Renderer, router: Router, metrics: FrontendMetrics,
                 bind: str = "tcp://127.0.0.1:0", max_queued_requests: int = 256,
                 heartbeat_timeout_s: float = 1.5, link: EngineLinkSecurity | None = None,
                 retry_on_engine_failure: int = 1) -> None:
        self.renderer, self.router, self.metrics = renderer, router, metrics
        self.retry_on_engine_failure = retry_on_engine_failure
        self.max_queued_requests = max_queued_requests
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.instances: dict[str, Instance] = {}
        self.requests: dict[str, RequestState] = {}
        self.codec = Codec()
        self.ctx = zmq.asyncio.Context()
        self.socket = self.ctx.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unknown peer: an error, not a silent drop
        self.socket.setsockopt(zmq.LINGER, 0)
        self.link = link
        if link is not None:  # CurveZMQ: only engines holding the shared secret get through
            link.secure_server(self.socket, self.ctx)
        self.socket.bind(bind)
        self.address: str = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._outbox: asyncio.Queue[tuple[bytes, bytes]] = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self._processes: dict[str, subprocess.Popen] = {}

    # ---- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        self._tasks = [asyncio.create_task(coro) for coro in
                       (self._receive_loop(), self._send_loop(), self._watchdog_loop())]

    def attach_process(self, engine_id: str, process: subprocess.Popen) -> None:
        """Launch tells us which child runs an engine, so an exit is noticed at once."""
        self._processes[engine_id] = process

    async def wait_ready(self, engine_ids: list[str], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not all(i in self.instances for i in engine_ids):
            for engine_id, proc in self._processes.items():
                if proc.poll() is not None and engine_id not in self.instances:
                    raise RuntimeError(f"engine {engine_id} exited with code {proc.returncode} during startup")
            if time.monotonic() > deadline:
                missing = [i for i in engine_ids if i not in self.instances]
                raise TimeoutError(f"engines {missing} not ready after {timeout_s:.0f} s")
            await asyncio.sleep(0.05)

    async def shutdown(self) -> None:
        for engine_id, inst in self.instances.items():
            if inst.alive:
                self._send(engine_id, Shutdown("frontend stopping"))
        await asyncio.sleep(0.1)  # let the send loop flush the shutdowns
        for task in self._tasks:
            task.cancel()
        self.socket.close(linger=0)
        if self.link is not None:
            self.link.close()
        self.ctx.term()

    # ---- properties the API needs ------------------------------------------------------

    def live_instances(self) -> list[Instance]:
        return [i for i in self.instances.values() if i.alive]

    @property
    def model_name(self) -> str:
        return next(iter(self.instances.values())).hello.model_name

    @property
    def max_model_len(self) -> int:
        return min(i.hello.max_model_len for i in self.instances.values())

    @property
    def vocab_size(self) -> int:
        return min(i.hello.vocab_size for i in self.instances.values())

    # ---- requests ----------------------------------------------------------------------

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               stop: list[str]) -> RequestStream:
        """Routes and sends one request. Raises NoInstanceAvailable when all queues are full."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in flight; send a unique X-Request-Id")
        routable = RoutableRequest(request_id, len(prompt_token_ids), params.max_tokens, prefix_key(prompt_token_ids))
        plan = self.router.pick(routable)
        self.router.on_start(plan, routable)
        state = RequestState(request_id, plan.prefill_instance_id or plan.instance_id,
                             self.renderer.new_output_text(stop), len(prompt_token_ids))
        wire = WireSamplingParams(
            max_tokens=params.max_tokens, temperature=float(params.temperature), top_p=float(params.top_p),
            top_k=params.top_k, seed=params.seed, min_tokens=params.min_tokens,
            stop_token_ids=list(params.stop_token_ids), ignore_eos=params.ignore_eos)
        if plan.prefill_instance_id is not None:
            state.prefill_instance_id, state.decode_instance_id = plan.prefill_instance_id, plan.instance_id
        state.prompt_token_ids, state.wire_params = list(prompt_token_ids), wire  # kept for a handover or a retry
        self.requests[request_id] = state
        self._send(state.instance_id, GenerateRequest(request_id, list(prompt_token_ids), wire))
        return RequestStream(self, state)

    def abort(self, request_id: str) -> None:
        state = self.requests.pop(request_id, None)
        if state is None:
            return
        self._release(state)
        self.metrics.requests.labels("abort").inc()
        # Wakes a consumer still waiting on this request (the disconnect watcher aborts it).
        state.queue.put_nowait(GenerationEvent("", 0, state.num_prompt_tokens, state.num_completion_tokens,
                                               True, "abort"))

    def _release(self, state: RequestState, abort: bool = True) -> None:
        """The request is over here: forget it in the router and, unless its engines finished it
        themselves, abort it on every instance that may hold it (an unknown id is a no-op
        there), so each frees its blocks."""
        for instance_id in state.holders():
            self.router.on_finish(instance_id, state.request_id)
            inst = self.instances.get(instance_id)
            if abort and inst is not None and inst.alive:
                self._send(instance_id, AbortRequests([state.request_id]))

    def _hand_over(self, state: RequestState, out: TokenOutput) -> None:
        """P finished the prompt: D pulls its KV and continues after the first token."""
        self.router.on_finish(state.instance_id, state.request_id)
        state.instance_id = state.decode_instance_id
        self._send(state.instance_id, GenerateRequest(state.request_id, state.prompt_token_ids, state.wire_params,
                                                      out.kv_descriptor, list(out.new_token_ids)))

    def _send(self, engine_id: str, message: ToEngine) -> None:
        self._outbox.put_nowait((socket_identity(engine_id, "in"), self.codec.encode(message)))

    async def _send_loop(self) -> None:
        while True:
            identity, payload = await self._outbox.get()
            try:
                await self.socket.send_multipart([identity, payload])
            except zmq.ZMQError as e:  # the peer is gone; the watchdog ends its requests
                log.warning("cannot send to %s: %s", identity.decode(errors="replace"), e)

    # ---- the only loop over engine outputs ---------------------------------------------

    async def _receive_loop(self) -> None:
        while True:
            frames = await self.socket.recv_multipart()
            if len(frames) != 2:
                log.warning("dropping a message with %d frames", len(frames))
                continue
            identity, payload = frames
            try:
                message = self.codec.from_engine.decode(payload)
            except msgspec.DecodeError as e:
                log.warning("dropping an undecodable message from %r: %s", identity[:64], e)
                continue
            engine_id = identity.decode(errors="replace").rsplit("/", 1)[0]
            if message.engine_id != engine_id:
                log.warning("dropping a message claiming engine %r from socket %r", message.engine_id, identity)
                continue
            if isinstance(message, EngineHello):
                self._register(message)
                continue
            inst = self.instances.get(engine_id)
            if inst is None or not inst.alive:
                continue
            inst.last_seen = time.monotonic()
            if isinstance(message, StepOutputs):
                self._handle_outputs(message)
            elif isinstance(message, EngineStats):
                inst.stats = message
                self.metrics.observe_stats(message)
                self.router.set_free_blocks(engine_id, message.num_free_blocks)
            elif isinstance(message, Heartbeat):
                pass

    def _register(self, hello: EngineHello) -> None:
        if hello.protocol_version != PROTOCOL_VERSION:
            log.error("engine %s speaks protocol %d, we speak %d: ignored", hello.engine_id,
                      hello.protocol_version, PROTOCOL_VERSION)
            return
        process = self._processes.get(hello.engine_id)
        if process is not None and process.poll() is not None:  # an engine restarted by hand under this id
            del self._processes[hello.engine_id]
            process = None
        self.instances[hello.engine_id] = Instance(hello, time.monotonic(), process=process)
        self.router.add_instance(hello.engine_id, hello.role, hello.max_num_seqs + self.max_queued_requests)
        self.metrics.set_alive(hello.engine_id, hello.role, True)
        log.info("engine %s ready (%s, pid %d, %d KV blocks)", hello.engine_id, hello.role, hello.pid,
                 hello.num_blocks_total)

    def _handle_outputs(self, message: StepOutputs) -> None:
        now = time.monotonic()
        for out in message.outputs:
            state = self.requests.get(out.request_id)
            if state is None:  # aborted or stopped here while the engine was still stepping
                continue
            is_first = state.num_completion_tokens == 0
            state.num_completion_tokens += len(out.new_token_ids)
            if out.new_token_ids:
                if state.last_token_at is None:
                    self.metrics.ttft.observe(now - state.arrival)
                else:
                    self.metrics.inter_token.observe(now - state.last_token_at)
                state.last_token_at = now
            self.router.on_progress(state.instance_id, state.request_id,
                                    state.num_prompt_tokens if is_first else 0, len(out.new_token_ids))
            handed_over = out.finish_reason == "prefill_done"
            finished, reason = out.finished and not handed_over, out.finish_reason
            text = state.output_text.add_tokens(out.new_token_ids, finished)
            if state.output_text.stopped and not finished:
                finished, reason = True, "stop"  # _finish aborts it everywhere: frees its blocks now
            elif handed_over:
                self._hand_over(state, out)
            kv_report = None
            if out.kv_transfer is not None:
                kv_report = trial_report(out.kv_transfer, reason)
                self.metrics.observe_transfer(out.kv_transfer, kv_report["outcome"])
            event = GenerationEvent(text, len(out.new_token_ids), state.num_prompt_tokens,
                                    state.num_completion_tokens, finished, reason if finished else None,
                                    out.error, out.rejected, kv_report, state.num_retries,
                                    list(out.new_token_ids))
            if finished:
                # an engine error (a refused handover, a failed transfer) may leave P holding blocks
                self._finish(state, "rejected" if out.rejected else reason,
                             abort=not out.finished or reason == "error")
                self.metrics.prompt_tokens.inc(state.num_prompt_tokens)
            state.queue.put_nowait(event)
            self.metrics.generation_tokens.inc(len(out.new_token_ids))

    def _finish(self, state: RequestState, outcome: str | None, abort: bool) -> None:
        self.requests.pop(state.request_id, None)
        self._release(state, abort)
        self.metrics.requests.labels(outcome or "error").inc()
        self.metrics.e2e.observe(time.monotonic() - state.arrival)

    # ---- noticing dead engines ---------------------------------------------------------

    def drain(self, engine_id: str) -> None:
        """No new requests for this instance; the watchdog shuts it down once it is empty."""
        self.router.drain(engine_id)
        log.warning("engine %s is draining", engine_id)

    def _drained(self, engine_id: str, inst: Instance) -> bool:
        load = self.router.instances.get(engine_id)
        if load is None or not load.draining or load.num_requests:
            return False
        held = inst.stats.kv.num_held_blocks if inst.stats is not None and inst.stats.kv is not None else 0
        return held == 0  # a prefill instance may still hold KV a decode instance is pulling

    async def _watchdog_loop(self) -> None:
        while True:
            await asyncio.sleep(0.2)
            now = time.monotonic()
            for engine_id, inst in list(self.instances.items()):
                if not inst.alive:
                    continue
                if self._drained(engine_id, inst):
                    inst.alive = False
                    self.router.mark_dead(engine_id)
                    self.metrics.set_alive(engine_id, inst.hello.role, False)
                    self._send(engine_id, Shutdown("drained by the admin API"))
                    log.warning("engine %s drained and told to shut down", engine_id)
                    continue
                exited = inst.process is not None and inst.process.poll() is not None
                silent = now - inst.last_seen > self.heartbeat_timeout_s
                if exited or silent:
                    why = (f"exited with code {inst.process.returncode}" if exited
                           else f"sent nothing for {self.heartbeat_timeout_s:g} s")
                    self.mark_dead(engine_id, why)

    def _retry(self, state: RequestState, dead_id: str) -> bool:
        """Sends a request whose engine died again, to another instance, if no token of it has
        reached the client yet (so the client cannot tell) and it has retries left."""
        if state.num_completion_tokens or state.num_retries >= self.retry_on_engine_failure:
            return False
        routable = RoutableRequest(state.request_id, state.num_prompt_tokens, state.wire_params.max_tokens)
        try:
            plan = self.router.pick(routable)
        except NoInstanceAvailable:
            return False
        self._release(state)  # a decode instance waiting for it forgets it
        self.router.on_start(plan, routable)
        state.num_retries += 1
        self.metrics.retries.inc()
        state.instance_id = plan.prefill_instance_id or plan.instance_id
        if plan.prefill_instance_id is not None:
            state.prefill_instance_id, state.decode_instance_id = plan.prefill_instance_id, plan.instance_id
        else:
            state.prefill_instance_id = state.decode_instance_id = None
        self._send(state.instance_id, GenerateRequest(state.request_id, state.prompt_token_ids, state.wire_params))
        log.warning("request %s: engine %s died before its first token; retry %d on %s", state.request_id,
                    dead_id, state.num_retries, state.instance_id)
        return True

    def mark_dead(self, engine_id: str, why: str) -> None:
        inst = self.instances[engine_id]
        inst.alive = False
        log.error("engine %s is dead (%s); failing its requests", engine_id, why)
        self.metrics.set_alive(engine_id, inst.hello.role, False)
        for request_id in self.router.mark_dead(engine_id):
            state = self.requests.get(request_id)
            if state is None or self._retry(state, engine_id):
                continue
            self.requests.pop(request_id)
            self._release(state)  # the request's other instance frees it too
            self.metrics.requests.labels("error").inc()
            state.queue.put_nowait(GenerationEvent(
                "", 0, state.num_prompt_tokens, state.num_completion_tokens, True, "error",
                f"engine instance {engine_id} died ({why}) while serving this request",
                num_retries=state.num_retries))
