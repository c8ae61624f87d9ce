"""splitserve: serve a language model with prefill and decode on separate engine instances,
and measure on your own workload whether separating them helps."""

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    # Lazy, so that `splitserve trial` and the frontend never pay for importing torch.
    if name == "LLM":
        from splitserve.entrypoints.llm import LLM
        return LLM
    if name == "SamplingParams":
        from splitserve.sampling import SamplingParams
        return SamplingParams
    raise AttributeError(name)
