"""The coordinator as one object: the engine link, the dispatcher and the role changer, wired.

    submit(ids) --> Dispatcher --EngineLink--> engines
    engines --EngineLink (I/O thread)--> Dispatcher --OutputProcessor--> TokenStream --> the API

Each object owns one job (engine_link.py: sockets and liveness; dispatcher.py: routing, handover,
retries and resumes; output_processor.py: token events and metrics; role_change.py: live role
changes and the load view); this class only wires them and answers the questions asked of the
instances. It speaks token ids: the text is the API's (api/engine_client.py, api/text_stream.py).
"""
from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import time
from collections import deque
from collections.abc import Callable

from splitserve.coordinator.disagg_policy import DisaggPolicy
from splitserve.coordinator.dispatcher import Dispatcher
from splitserve.coordinator.engine_link import EngineLink
from splitserve.coordinator.metrics import FrontendMetrics
from splitserve.coordinator.output_processor import OutputProcessor
from splitserve.coordinator.request_state import EventSink, Instance, TokenStream
from splitserve.coordinator.role_change import InstanceLoadView
from splitserve.coordinator.router import Router
from splitserve.link_security import EngineLinkSecurity
from splitserve.protocol import SetChunkTokens, SetStreamCap
from splitserve.sampling import SamplingParams


class ServedInstances:
    """What the API asks about the engine instances, answered from `instances` (the engine link's
    here; in an API process of `serve --api-server-count N`, the coordinator's last snapshot)."""

    instances: dict[str, Instance]

    def live_instances(self) -> list[Instance]:
        return [i for i in self.instances.values() if i.alive]

    @property
    def model_name(self) -> str:
        return next(iter(self.instances.values())).hello.model_name

    @property
    def max_model_len(self) -> int:
        return min(i.hello.max_model_len for i in self._sizing_instances())

    @property
    def vocab_size(self) -> int:
        return min(i.hello.vocab_size for i in self._sizing_instances())

    def _sizing_instances(self) -> list[Instance]:
        return self.live_instances() or list(self.instances.values())


class Coordinator(ServedInstances):
    def __init__(self, router: Router, metrics: FrontendMetrics, bind: str = "tcp://127.0.0.1:0",
                 max_queued_requests: int = 256, heartbeat_timeout_s: float = 1.5,
                 link: EngineLinkSecurity | None = None, retry_on_engine_failure: int = 1,
                 orphan_grace_s: float = 10.0, disagg_policy: DisaggPolicy | None = None) -> None:
        self.router, self.metrics = router, metrics
        self.link = EngineLink(bind, link, heartbeat_timeout_s, orphan_grace_s)
        self.outputs = OutputProcessor(metrics)
        self.dispatcher = Dispatcher(self.link, router, self.outputs, metrics, max_queued_requests,
                                     retry_on_engine_failure, disagg_policy)
        self.roles = self.dispatcher.roles
        self.address = self.link.address
        # (monotonic time, prompt tokens, max answer tokens) of recent submissions: the demand an
        # adaptive mix (coordinator/adaptive.py) plans for; bounded, read-only to others
        self.arrivals: deque[tuple[float, int, int, str]] = deque(maxlen=4096)
        # serve --adaptive: an SLO class's TTFT target, seconds (each request's deadline goes to the engine)
        self.ttft_target_of: Callable[[str], float] | None = None

    @property
    def instances(self) -> dict[str, Instance]:
        return self.link.instances

    # ---- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        self.link.start(self.dispatcher)

    def attach_process(self, engine_id: str, process: subprocess.Popen) -> None:
        self.link.attach_process(engine_id, process)

    async def wait_ready(self, engine_ids: list[str], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not all(i in self.instances for i in engine_ids):
            for engine_id in engine_ids:
                proc = self.link.process_exited(engine_id)
                if proc is not None and engine_id not in self.instances:
                    raise RuntimeError(f"engine {engine_id} exited with code {proc.returncode} during startup")
            if time.monotonic() > deadline:
                missing = [i for i in engine_ids if i not in self.instances]
                raise TimeoutError(f"engines {missing} not ready after {timeout_s:.0f} s")
            await asyncio.sleep(0.05)

    async def shutdown(self, shutdown_engines: bool = True) -> None:
        await self.link.close(shutdown_engines)

    # ---- requests and instances --------------------------------------------------------------

    def submit_tokens(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                      priority: int = 0, events: EventSink | None = None, slo_class: str = "") -> TokenStream:
        """The coordinator's one way in: token ids in, a TokenStream of token ids out; closing
        the stream aborts the request (reason "abort", or "stop" for a stop string the API found).
        request_id is the client's (X-Request-Id); inside, every dispatch gets a unique one.
        Raises router.NoInstanceAvailable or ValueError (a parameter that cannot be sent).
        events: see Dispatcher.submit (a request of an API process). slo_class: the request's
        SLO class, kept with its arrival for the adaptive mix's demand reading, and, where
        ttft_target_of is set (serve --adaptive: the class's TTFT target), its first token's
        deadline goes to the engine with it."""
        target = self.ttft_target_of(slo_class) if self.ttft_target_of is not None else None
        stream = self.dispatcher.submit(request_id, prompt_token_ids, params, priority, events, target)
        self.arrivals.append((time.monotonic(), len(prompt_token_ids), params.max_tokens, slo_class))
        return stream

    def drain(self, engine_id: str) -> None:
        """No new requests for this instance; it is told to stop once it holds nothing."""
        self.router.drain(engine_id)

    async def change_role(self, instance_id: str, role: str) -> None:
        """Live role change; raises role_change.RoleChangeRefused (with .status) when it cannot be made."""
        await self.roles.change_role(instance_id, role)

    def set_chunk_tokens(self, tokens: int | None) -> None:
        """Every live instance's prompt tokens per step beside its streams (None: each role's own)."""
        for engine_id, inst in self.instances.items():
            if inst.alive:
                self.link.send(engine_id, SetChunkTokens(tokens or 0))

    def set_stream_caps(self, caps: dict[str, int | None]) -> None:
        """Each named live instance's stream cap (None: max_num_seqs alone; Scheduler.max_streams).
        A decode instance's also holds, in the dispatcher, separated plans onto it while it is full:
        its engine never holds a stream that was handed over."""
        for engine_id, streams in caps.items():
            inst = self.instances.get(engine_id)
            if inst is not None and inst.alive:
                self.link.send(engine_id, SetStreamCap(streams or 0))
                self.dispatcher.set_stream_cap(engine_id, streams)  # read only while it decodes

    def load_view(self) -> list[InstanceLoadView]:
        """The instances' loads; prompts the dispatcher holds for a full decode instance count as
        queued on the prefill instance with the least queued (they go there once room opens), so the
        mix controller sees the queue it made (Dispatcher.held)."""
        views = self.roles.load_view()
        held = sum(len(s.prompt_token_ids) for s in self.dispatcher.held)
        prefill = [v for v in views if v.role == "prefill" and v.alive]
        if held and prefill:
            least = min(prefill, key=lambda v: v.num_queued_prompt_tokens)
            views = [dataclasses.replace(v, num_queued_prompt_tokens=v.num_queued_prompt_tokens + held)
                     if v is least else v for v in views]
        return views
