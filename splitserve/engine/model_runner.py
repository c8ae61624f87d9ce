"""Turns a scheduled batch into tensors, runs the model on the paged KV cache, samples."""
from __future__ import annotations

import torch

from splitserve.config import CacheConfig, ModelConfig
from splitserve.devices import synchronize
from splitserve.engine.request import Request
from splitserve.engine.sampler import prompt_token_logprobs, sample, token_logprobs
from splitserve.engine.scheduler import ScheduledBatch
from splitserve.engine.structured import advance_grammars, apply_grammar_masks
from splitserve.models.llama import DecodeGroup, ForwardBatch, LlamaModel, PrefillChunk
from splitserve.protocol import TokenLogprobs


DECODE_GROUP_SLACK = 128  # tokens of padding a decode group tolerates beyond twice its shortest


def group_by_length(lens: list[int], slack: int | None = None) -> list[tuple[int, int]]:
    """Split ascending context lengths into runs [(start, count)] whose longest is at most
    twice the shortest plus `slack` tokens. Decode attention pads each run to its longest member,
    so one 2k-token sequence among short chats would otherwise make every chat attend over 2k
    padded positions (measured: a 170 ms step became 370-530 ms at 8 chats + one 2k context)."""
    slack = DECODE_GROUP_SLACK if slack is None else slack
    groups: list[tuple[int, int]] = []
    start = 0
    for i in range(1, len(lens) + 1):
        if i == len(lens) or lens[i] > 2 * lens[start] + slack:
            groups.append((start, i - start))
            start = i
    return groups


def prompt_score_rows(batch: ScheduledBatch) -> list[tuple[int, Request, int]]:
    """(index in the step's input tokens, request, prompt position scored there) for every prompt
    token a prefill chunk of a request asking for prompt logprobs predicts: the logits at position
    p score prompt token p + 1. Only on the request's own prefill (a request that arrives with its
    first token, at a decode instance, was scored where it was prefilled), and never twice (a
    preempted request recomputes positions it has scored)."""
    rows = []
    index = len(batch.decodes)  # build_batch lays out the decodes first, then each chunk in order
    for request, num_new in batch.prefills:
        start = request.num_computed_tokens
        if request.params.prompt_logprobs is not None and not request.output_token_ids:
            last = min(start + num_new, request.num_prompt_tokens - 1)
            for pos in range(max(start, len(request.prompt_logprobs)), last):
                rows.append((index + pos - start, request, pos + 1))
        index += num_new
    return rows


def prefill_slots(block_ids: list[int], start_pos: int, end_pos: int, block_size: int) -> torch.Tensor:
    """Flat cache slots (block_id * block_size + offset) of positions start_pos..end_pos - 1, as a
    host tensor: an 8k-token prompt must not cost 8k turns of a Python loop."""
    pos = torch.arange(start_pos, end_pos)
    return torch.tensor(block_ids, dtype=torch.long)[pos // block_size] * block_size + pos % block_size


class ModelRunner:
    def __init__(self, model_config: ModelConfig, weights: dict[str, torch.Tensor],
                 cache_config: CacheConfig, device: str = "cpu", dtype: torch.dtype = torch.float32,
                 allocate_pool=None):
        self.device = torch.device(device)
        self.model = LlamaModel(model_config, weights, device, dtype)
        self.block_size = cache_config.block_size
        self.num_blocks = cache_config.num_blocks(model_config)
        c = model_config
        # Allocated once; every engine role uses the same layout so blocks can be shipped as-is.
        # [num_layers, 2 (k, v), num_kv_heads, num_blocks, block_size, head_dim]
        shape = (c.num_layers, 2, c.num_kv_heads, self.num_blocks, self.block_size, c.head_dim)
        if allocate_pool is None:  # (shape, dtype) -> tensor; a prefill instance puts it in shared memory
            self.kv_cache = torch.zeros(shape, device=self.device, dtype=dtype)
        else:
            self.kv_cache = allocate_pool(shape, dtype)
        self.model.block_size = self.block_size
        self.last_logprobs: dict[Request, TokenLogprobs] = {}  # the last step's, for requests that asked

    def _tensor(self, data, dtype=torch.long) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype, device=self.device)

    def build_batch(self, batch: ScheduledBatch) -> tuple[ForwardBatch, list[Request]]:
        bs = self.block_size
        input_ids, positions, slots, samplers, sample_indices = [], [], [], [], []
        # Decodes in ascending context length, so similar lengths share one padded attention.
        decodes = sorted(batch.decodes, key=lambda r: r.num_computed_tokens)
        for request in decodes:
            pos = request.num_computed_tokens
            input_ids.append(request.token_id(pos))
            positions.append(pos)
            slots.append(request.block_table[pos // bs] * bs + pos % bs)
            sample_indices.append(len(input_ids) - 1)
            samplers.append(request)
        decode_groups = []
        lens = [r.num_computed_tokens + 1 for r in decodes]
        for start, count in group_by_length(lens):
            members, group_lens = decodes[start:start + count], lens[start:start + count]
            width = -(-group_lens[-1] // bs)
            decode_groups.append(DecodeGroup(
                start=start, count=count, context_lens=self._tensor(group_lens),
                block_tables=self._tensor([r.block_table[:width] + [0] * (width - len(r.block_table[:width]))
                                           for r in members])))
        chunks = []
        slot_parts = [torch.tensor(slots, dtype=torch.long)]  # host tensors, one device copy below
        for request, num_new in batch.prefills:
            start_pos = request.num_computed_tokens
            end_pos = start_pos + num_new
            tokens = request.all_token_ids[start_pos:end_pos]
            blocks = request.block_table[:-(-end_pos // bs)]
            chunks.append(PrefillChunk(
                start=len(input_ids), num_tokens=num_new, num_context_tokens=end_pos,
                block_ids=self._tensor(blocks)))
            input_ids.extend(tokens)
            positions.extend(range(start_pos, end_pos))
            slot_parts.append(prefill_slots(blocks, start_pos, end_pos, bs))
            if end_pos == request.num_tokens:
                sample_indices.append(len(input_ids) - 1)
                samplers.append(request)
        forward_batch = ForwardBatch(
            input_ids=self._tensor(input_ids), positions=self._tensor(positions),
            slot_mapping=torch.cat(slot_parts).to(self.device), num_decode_tokens=len(decodes),
            decode_groups=decode_groups, prefills=chunks, sample_indices=self._tensor(sample_indices))
        return forward_batch, samplers

    def synchronize(self) -> None:
        """Wait until the device has run what this step queued (step timing reads a clock next)."""
        synchronize(self.device)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, default_generator: torch.Generator) -> dict[Request, int]:
        """Run one step; returns the sampled token for each request that reached its end."""
        forward_batch, samplers = self.build_batch(batch)
        scored = prompt_score_rows(batch)
        if scored:
            forward_batch.sample_indices = torch.cat([forward_batch.sample_indices,
                                                      self._tensor([index for index, _, _ in scored])])
        logits = self.model.forward(forward_batch, self.kv_cache)  # [num_samples + num_scored, vocab]
        if scored:
            logits, prompt_logits = logits[:len(samplers)], logits[len(samplers):]
            prompt_token_logprobs(prompt_logits, [(r, r.prompt_token_ids[pos]) for _, r, pos in scored])
        self.last_logprobs = {}
        if not samplers:
            return {}
        # sample() edits the logits in place (min_tokens bans): logprobs need the raw ones
        logits = logits.float()  # the grammar mask kernel wants fp32 (a no-op for the fp32 model)
        raw = logits.clone() if any(r.params.logprobs is not None for r in samplers) else None
        apply_grammar_masks(logits, samplers)
        tokens = sample(logits, samplers, default_generator)
        advance_grammars(samplers, tokens)
        if raw is not None:
            self.last_logprobs = token_logprobs(raw, samplers, tokens)
        return dict(zip(samplers, tokens))
