"""The planner's simulator speed: 10,000 requests on 20 arrangements (issue 12 asks for < 10 s).

    .venv/bin/python bench/planner_speed.py [--profile profile.json] [--requests 10000]

A doc-heavy mix (one 1,200-1,800-token document per six requests, 48-token answers) at a rate
each arrangement of 2 cores can nearly keep up with; prints wall and CPU seconds, so a shared
machine's load can be told apart from the simulator's own cost.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from splitserve.control.planner import enumerate_arrangements  # noqa: E402
from splitserve.control.predict import predict  # noqa: E402
from splitserve.control.profile_file import FORMAT, load_profile, parse_profile  # noqa: E402
from splitserve.control.simulator import SimRequest  # noqa: E402
from splitserve.trial.spec import SLO  # noqa: E402

# The bundled model on the shared 2-core box (docs/benchmarks.md, "Planner"), 1 thread.
DEFAULT_PROFILE = {"format": FORMAT, "model": {"name": "SmolLM2-135M", "kv_bytes_per_token": 46080},
                   "threads": {"1": {"step_model": {"overhead_s": 0.045, "per_prefill_token_s": 0.0027,
                                                    "per_prefill_attn_s": 0.001, "per_decode_seq_s": 0.0051,
                                                    "per_decode_kv_token_s": 1.5e-5}}},
                   "kv_transfer": {"shm": {"latency_s": 0.005, "gb_per_s": 7.0}}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default=None)
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--rate", type=float, default=0.4)
    args = parser.parse_args()
    profile = load_profile(args.profile) if args.profile else parse_profile(DEFAULT_PROFILE)
    rng = random.Random(0)
    requests, t = [], 0.0
    for i in range(args.requests):
        t += rng.expovariate(args.rate)
        prompt = rng.randint(1200, 1800) if i % 6 == 5 else rng.randint(32, 96)
        requests.append(SimRequest(i, t, prompt, 48))
    arrangements = enumerate_arrangements(2, budgets=(64, 128, 256, 512, 1024))
    arrangements = (arrangements * 2)[:20]
    slo = SLO(ttft_s=10.0, gap_s=0.5, e2e_s=30.0, max_pause_s=1.5)
    wall, cpu = time.perf_counter(), time.process_time()
    results = {a.name: predict(a, profile, requests, slo)["attainment"] for a in arrangements}
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    print(f"{len(requests)} requests x {len(arrangements)} arrangements: {wall:.1f} s wall, {cpu:.1f} s CPU")
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
