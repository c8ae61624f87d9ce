"""Soak: a bounded mixed load with random aborts and disconnects, then check nothing leaked.

    .venv/bin/python bench/soak.py [--seconds 300] [--rate 8] [--json out.json]

Starts `splitserve serve` on loopback (tiny random-weight model, 2 engines), warms up, takes a
baseline (open fds, threads and RSS of every process), then sends a mix for `seconds`: stream
and non-stream requests of mixed lengths, a share of streams abandoned after a few chunks and
of non-stream requests abandoned by a short client timeout. Afterwards every engine must report
all KV blocks free, and fds/threads/RSS are compared with the baseline.
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "bench"))

from load import ProcessWatch, open_loop, random_completion, sample_tree, serve_and_report  # noqa: E402
from serve_support import ServerProcess, all_blocks_free, wait_until  # noqa: E402


def start_server(root: Path, instances: int) -> ServerProcess:
    from tiny_models import write_tiny_checkpoint

    model = write_tiny_checkpoint(root / "tiny", arch="llama")
    return ServerProcess(str(model), "--max-num-seqs", "16", "--max-queued-requests", "32", "--kv-cache-memory",
                         "8MiB", instances=instances, log_path=root / "server.log").wait_ready()


def mixed_requests(seed: int, abort_share: float):
    rng = random.Random(seed)

    def make(i: int):
        body = random_completion(rng, max_prompt_words=60, max_tokens=(2, 96))
        leave = rng.randint(1, 6) if rng.random() < abort_share else None
        return body, leave

    return make


def totals(sample) -> dict:
    return {"fds": sum(sample.num_fds.values()), "threads": sum(sample.num_threads.values()),
            "rss_mib": round(sum(sample.rss_bytes.values()) / 2**20, 1),
            "per_process_fds": sorted(sample.num_fds.values())}


async def soak(srv: ServerProcess, seconds: float, rate: float, abort_share: float, warmup_s: float) -> dict:
    base = srv.base_url
    await open_loop(base, rate, warmup_s, mixed_requests(1, abort_share))  # caches, pools, lazy imports
    assert wait_until(lambda: all_blocks_free(base), timeout_s=30), "blocks in use after the warm-up"
    time.sleep(1.0)
    before = totals(sample_tree(srv.proc.pid))
    with ProcessWatch(srv.proc.pid, interval_s=1.0) as watch:
        load = await open_loop(base, rate, seconds, mixed_requests(2, abort_share), timeout_s=120.0)
    blocks_free = wait_until(lambda: all_blocks_free(base), timeout_s=30)
    time.sleep(2.0)  # let closed connections and finished requests settle
    after = totals(sample_tree(srv.proc.pid))
    return {"seconds": round(load.seconds, 1), "offered": load.offered, "outcomes": load.counts(),
            "all_blocks_free_after": blocks_free, "before": before, "after": after,
            "fd_growth": after["fds"] - before["fds"], "thread_growth": after["threads"] - before["threads"],
            "rss_growth_mib": round(after["rss_mib"] - before["rss_mib"], 1),
            "peak_rss_mib": watch.peak_by_name_mib()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=300.0)
    p.add_argument("--rate", type=float, default=8.0, help="requests per second")
    p.add_argument("--abort-share", type=float, default=0.3)
    p.add_argument("--warmup-seconds", type=float, default=10.0)
    p.add_argument("--instances", type=int, default=2)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    report = serve_and_report(lambda root: start_server(root, args.instances),
                              lambda srv: soak(srv, args.seconds, args.rate, args.abort_share, args.warmup_seconds),
                              args.json)
    leaked = report["fd_growth"] > 0 or report["thread_growth"] > 0 or not report["all_blocks_free_after"]
    return 1 if leaked or report["outcomes"].get("server_error") else 0


if __name__ == "__main__":
    raise SystemExit(main())
