"""Shared helpers for engine tests: build an EngineCore on a tiny checkpoint and run it dry."""
from __future__ import annotations

import torch

from splitserve.config import CacheConfig, EngineConfig, SchedulerConfig
from splitserve.engine.core import EngineCore
from splitserve.models.loader import load_model


def make_engine(model_dir, *, policy="chunked", budget=64, kv="2MiB", block_size=16, max_num_seqs=64,
                prefix=True, role="colocated", kv_transfer=None, failure_policy="recompute",
                instance_id="engine-0", scheduling_policy="fcfs", clock=None) -> EngineCore:
    if role != "colocated" and kv_transfer is None:
        from splitserve.kv_transfer import KVTransferConfig
        kv_transfer = KVTransferConfig(transport="tcp")
    config = EngineConfig(
        model=str(model_dir),
        cache=CacheConfig(block_size=block_size, kv_cache_memory=kv, enable_prefix_caching=prefix),
        scheduler=SchedulerConfig(prefill_policy=policy, max_num_batched_tokens=budget,
                                  max_num_seqs=max_num_seqs, scheduling_policy=scheduling_policy),
        role=role, kv_transfer=kv_transfer, kv_failure_policy=failure_policy, instance_id=instance_id)
    if clock is None:
        return EngineCore(config, load_model(str(model_dir)))
    return EngineCore(config, load_model(str(model_dir)), clock=clock)


def run_to_end(engine: EngineCore, max_steps: int = 100_000) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return tokens
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    raise AssertionError("engine did not finish")


def hf_greedy(model, prompt: list[int], num_new: int) -> list[int]:
    """Greedy continuation by transformers, ignoring EOS (the engine runs with ignore_eos)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=num_new, do_sample=False,
                             eos_token_id=None, pad_token_id=0, attention_mask=torch.ones(1, len(prompt),
                                                                                           dtype=torch.long))
    return out[0, len(prompt):].tolist()


def run_disaggregated(prefill: EngineCore, decode: EngineCore, requests, on_step=None,
                      max_steps: int = 100_000, outputs: list | None = None):
    """Drive a prefill and a decode engine in one process, forwarding KV descriptors as the
    frontend would. requests: [(request_id, prompt, params)]. Returns
    {request_id: (tokens, finish_reason, error, kv_transfer_record, kv_outcome)}; `outputs`, if
    given, receives every RequestOutput of both engines in order."""
    import time

    prompts = {rid: (prompt, params) for rid, prompt, params in requests}
    for rid, prompt, params in requests:
        prefill.add_request(rid, prompt, params)
    results: dict[str, list] = {}
    for step in range(max_steps):
        if not (prefill.has_unfinished_requests() or decode.has_unfinished_requests()):
            return {rid: tuple(r) for rid, r in results.items()}
        if on_step is not None:
            on_step(step)
        for out in prefill.step():
            if outputs is not None:
                outputs.append(out)
            results[out.request_id] = [list(out.new_token_ids), out.finish_reason, out.error, None, None]
            if out.kv_descriptor is not None:
                prompt, params = prompts[out.request_id]
                decode.add_request(out.request_id, prompt, params, kv_descriptor=out.kv_descriptor,
                                   first_token_ids=out.new_token_ids)
        for out in decode.step():
            if outputs is not None:
                outputs.append(out)
            entry = results[out.request_id]
            entry[0].extend(out.new_token_ids)
            entry[1], entry[2] = out.finish_reason, out.error
            entry[3] = out.kv_transfer or entry[3]
            entry[4] = out.kv_outcome or entry[4]
        if not (prefill.scheduler.has_unfinished() or decode.scheduler.has_unfinished()):
            time.sleep(0.001)  # only transfers in flight: let the puller threads work
    raise AssertionError("disaggregated run did not finish")
