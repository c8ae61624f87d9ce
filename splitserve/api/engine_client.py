"""What the HTTP layer and `serve` hold in the coordinator's process: the coordinator, made text.

    serving.py --generate--> EngineClient.submit --> Coordinator.submit_tokens --> TokenStream
      --TextStream (detokenize, stop strings)--> serving.py

An API process of `serve --api-server-count N` holds api_worker.RemoteEngineClient instead,
whose token streams come over ZeroMQ and are made text by the same TextStream.
"""
from __future__ import annotations

from splitserve.api.render import Renderer
from splitserve.api.text_stream import TextStream
from splitserve.coordinator.coordinator import Coordinator
from splitserve.coordinator.metrics import FrontendMetrics
from splitserve.coordinator.router import Router
from splitserve.sampling import SamplingParams


class EngineClient(Coordinator):
    def __init__(self, renderer: Renderer | None, router: Router, metrics: FrontendMetrics, **coordinator) -> None:
        """renderer may come later (serve loads the tokenizer while engines load); the rest is
        the Coordinator's."""
        super().__init__(router, metrics, **coordinator)
        self.renderer = renderer

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               stop: list[str], priority: int = 0, slo_class: str = "") -> TextStream:
        """request_id is the client's (X-Request-Id); inside, every dispatch gets a unique one."""
        output_text = self.renderer.new_output_text(stop)
        return TextStream(self.submit_tokens(request_id, prompt_token_ids, params, priority, slo_class=slo_class),
                          output_text)

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       stop: list[str], priority: int = 0, slo_class: str = "") -> TextStream:
        """What the HTTP layer calls: submit() here; a round trip to this process from an API
        process (api_worker.RemoteEngineClient.generate)."""
        return self.submit(request_id, prompt_token_ids, params, stop, priority, slo_class)
