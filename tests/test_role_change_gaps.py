"""No stream pays for a role change (issue 31): the inter-token gaps of streams already answering,
measured per token on the tiny model, stay as they are without a change. The bound compares the
same workload with and without the change on this machine, so it holds at any speed."""
from __future__ import annotations

import asyncio
import time

import pytest

from cluster_support import Cluster, prompt_of
from splitserve.config import CARRIED_CHUNK_TOKENS
from splitserve.sampling import SamplingParams
from tiny_models import write_tiny_checkpoint

PD = {"prefill-0": "prefill", "decode-0": "decode"}
NUM_STREAMS = 24


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("gaps") / "m", arch="llama")


async def token_times(cluster: Cluster, request_id: str, prompt: list[int], answering: asyncio.Event) -> list[float]:
    stream = cluster.client.submit(request_id, prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True), [])
    times = []
    async for event in stream:
        times += [time.monotonic()] * len(event.token_ids)
        if times:
            answering.set()
    return times


async def worst_gap(tiny, change: bool) -> tuple[float, list[list[float]]]:
    """Streams queued on the prefill instance, planned onto decode-0; once the first answers,
    decode-0 (optionally) becomes colocated. Returns the longest gap after a stream's first token."""
    async with Cluster(tiny, PD, kv="8MiB") as cluster:
        answering = asyncio.Event()
        streams = [asyncio.create_task(token_times(cluster, f"s{i}", prompt_of(320, i), answering))
                   for i in range(NUM_STREAMS)]
        await answering.wait()
        if change:
            await cluster.client.change_role("decode-0", "colocated")
        times = await asyncio.gather(*streams)
        assert all(len(t) == 40 for t in times)
        if change:
            assert cluster.client.instances["decode-0"].hello.role == "colocated"
        return max(b - a for t in times for a, b in zip(t, t[1:])), times


def test_a_decode_instance_changing_role_keeps_the_gaps_of_streams_already_answering(tiny):
    steady, _ = asyncio.run(worst_gap(tiny, change=False))
    across, times = asyncio.run(worst_gap(tiny, change=True))
    print(f"worst gap without a change {steady * 1e3:.1f} ms, across the change {across * 1e3:.1f} ms")
    # Before the fix the streams still prefilling were recomputed after the change, one behind
    # another: the last waited for every prompt before it (NUM_STREAMS steps of prompt and more).
    assert across <= 3 * steady, (across, steady)


# A colocated instance turning prefill keeps the streams it is decoding; documents then come to it
# to be prefilled for the decode instance. A model wide enough that a step's cost grows with its
# prompt tokens (the 64-wide one's steps cost about the same at any size), and a step budget of 1024.
WIDE = dict(hidden_size=512, intermediate_size=2048, num_attention_heads=8, num_key_value_heads=2,
            max_position_embeddings=2048)
BUDGET, DOCUMENT = 1024, 1000
CARRIED = {"c0": "colocated", "d0": "decode"}
NUM_CARRIED, NUM_DOCUMENTS = 8, 3


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("wide") / "m", arch="llama", **WIDE)


async def carried_gaps(model, change: bool) -> tuple[float, list[tuple[int, int]]]:
    """Streams answering on c0 (the decode instance beside it gets no new work); then, with
    `change`, c0 becomes prefill and documents arrive, prefilled there for d0. Returns the
    streams' longest gap after their first token, and c0's steps as (prompt tokens, decodes)."""
    async with Cluster(model, CARRIED, kv="16MiB", max_num_batched_tokens=BUDGET) as cluster:
        core = cluster.engines["c0"].core
        steps, schedule = [], core.scheduler.schedule

        def recorded():
            batch = schedule()
            steps.append((sum(n for _, n in batch.prefills), len(batch.decodes)))
            return batch

        core.scheduler.schedule = recorded
        events = [asyncio.Event() for _ in range(NUM_CARRIED)]
        streams = [asyncio.create_task(token_times(cluster, f"s{i}", prompt_of(24, i), e))
                   for i, e in enumerate(events)]
        for e in events:
            await e.wait()
        documents = []
        if change:
            await cluster.client.change_role("c0", "prefill")
            del steps[:]  # its steps as a prefill instance from here
            documents = [asyncio.create_task(cluster.generate(prompt_of(DOCUMENT, 100 + i), 4, f"doc{i}"))
                         for i in range(NUM_DOCUMENTS)]
        times = await asyncio.gather(*streams)
        for doc in await asyncio.gather(*documents):
            assert doc["error"] is None and len(doc["tokens"]) == 4
        assert all(len(t) == 40 for t in times)
        return max(b - a for t in times for a, b in zip(t, t[1:])), steps


def test_streams_carried_into_a_prefill_role_step_beside_small_chunks_not_whole_budgets(wide):
    steady, _ = asyncio.run(carried_gaps(wide, change=False))
    across, steps = asyncio.run(carried_gaps(wide, change=True))
    print(f"worst gap of the carried streams: alone {steady * 1e3:.1f} ms, beside the documents on the "
          f"prefill role {across * 1e3:.1f} ms")
    carried = [prompt for prompt, decodes in steps if decodes]
    assert max(carried) <= CARRIED_CHUNK_TOKENS, carried  # not the 1024-token budget the documents fill
    # once the last carried stream ended (within 39 steps), the documents left get whole budgets
    assert max(prompt for prompt, decodes in steps if not decodes) > CARRIED_CHUNK_TOKENS
    # Before the fix every step of the streams carried 1024 - 8 prompt tokens while documents waited
    # (worst gap 265 ms against 50 ms alone on a quiet box). The gaps are printed, not asserted: a
    # ratio of two timed runs failed under the suite's own two workers (37.6 ms against a 11.7 ms
    # baseline timed at a quieter moment); the step composition above is what the fix changes.
