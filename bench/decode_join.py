"""What a long request joining a decode instance does to the steps of the streams already there.

    .venv/bin/python bench/decode_join.py [--long-tokens 2048] [--streams 8] [--steps 20] [--one-group]

In one process, at one torch thread (the 1P+1D decode instance's budget): a prefill-role and a
decode-role EngineCore on the bundled model, KV over shm as in `serve --prefill 1 --decode 1`.
`--streams` short requests decode on the decode instance; then a `--long-tokens` prompt is
prefilled on the prefill instance, its KV handed over, and every decode step is timed while it
decodes beside them. Before the length-grouped decode attention (engine/model_runner.py) the
8-stream step went from ~110 ms to 370-530 ms here; after it, ~140 ms.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from splitserve.config import CacheConfig, EngineConfig, SchedulerConfig
from splitserve.engine.core import EngineCore
from splitserve.kv_transfer import KVTransferConfig
from splitserve.models.loader import bundled_model_path, load_model
from splitserve.sampling import SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--long-tokens", type=int, default=2048)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--one-group", action="store_true",
                   help="attend over all decodes as one padded group, as before the length groups")
    args = p.parse_args()
    if args.one_group:
        from splitserve.engine import model_runner

        model_runner.DECODE_GROUP_SLACK = 1 << 30
    torch.set_num_threads(1)
    path = str(bundled_model_path())
    loaded = load_model(path)

    def engine(role: str, instance_id: str) -> EngineCore:
        cfg = EngineConfig(model=path, cache=CacheConfig(kv_cache_memory="1GiB"),
                           role=role, scheduler=SchedulerConfig(prefill_policy="whole", max_num_batched_tokens=4096),
                           kv_transfer=KVTransferConfig(transport="shm"), instance_id=instance_id, num_threads=1)
        return EngineCore(cfg, loaded)

    prefill, decode = engine("prefill", "bench-p0"), engine("decode", "bench-d0")
    rng = random.Random(0)
    streams = SamplingParams(max_tokens=2000, temperature=0, ignore_eos=True)
    for i in range(args.streams):
        decode.add_request(f"s{i}", [rng.randrange(100, 40000) for _ in range(32)], streams)
    for _ in range(10):
        decode.step()

    def timed(n: int) -> list[float]:
        out = []
        for _ in range(n):
            t = time.perf_counter()
            decode.step()
            out.append(time.perf_counter() - t)
        return out

    before = timed(args.steps)
    long_params = SamplingParams(max_tokens=args.steps + 4, temperature=0, ignore_eos=True)
    prompt = [rng.randrange(100, 40000) for _ in range(args.long_tokens)]
    prefill.add_request("long", prompt, long_params)
    t = time.perf_counter()
    [first] = prefill.step()
    prefill_s = time.perf_counter() - t
    decode.add_request("long", prompt, long_params, kv_descriptor=first.kv_descriptor,
                       first_token_ids=first.new_token_ids)
    while "long" not in {r.request_id for r in decode.scheduler.running}:
        decode.step()  # the transfer lands; these steps decode the streams alone
    with_long = timed(args.steps)
    ms = lambda xs: f"median {statistics.median(xs) * 1e3:6.1f} ms, max {max(xs) * 1e3:6.1f} ms"  # noqa: E731
    print(f"{args.streams} streams alone:                 {ms(before)}")
    print(f"with the {args.long_tokens}-token request decoding: {ms(with_long)}")
    print(f"(its prefill took {prefill_s:.2f} s on the prefill instance)")
    prefill.close()
    decode.close()


if __name__ == "__main__":
    main()
