"""Peak resident memory of an engine holding the bundled model and a 1 GiB KV cache.

Runs in its own process (the benchmark starts it as a subprocess) so that nothing
else that process loaded is counted. Prints one JSON object.

    .venv/bin/python bench/peak_rss.py [--kv-cache-memory 1GiB]
"""
from __future__ import annotations

import argparse
import json
import resource

import psutil


def _max_rss_bytes() -> int:
    """Peak RSS of this process's own memory (VmHWM).

    getrusage's ru_maxrss is not used as the answer: a child forked from a large
    parent (the benchmark holds ~3 GiB when it starts this) inherits the parent's
    peak in ru_maxrss, while VmHWM belongs to the address space exec created.
    """
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # the kernel reports kB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # not Linux: best effort


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kv-cache-memory", default="1GiB")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    args = parser.parse_args()

    import torch

    from splitserve.config import CacheConfig, EngineConfig, parse_size
    from splitserve.engine.core import EngineCore
    from splitserve.sampling import SamplingParams

    torch.set_num_threads(1)
    after_import = _max_rss_bytes()
    engine = EngineCore(EngineConfig(cache=CacheConfig(kv_cache_memory=args.kv_cache_memory)))
    after_load = _max_rss_bytes()
    engine.add_request("rss", list(range(100, 100 + args.prompt_tokens)),
                       SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    print(json.dumps({
        "kv_cache_memory": parse_size(args.kv_cache_memory),
        "peak_rss_after_import": after_import,
        "peak_rss_after_load": after_load,
        "peak_rss": _max_rss_bytes(),
        "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        # Pages of the KV pool that no request wrote may never be touched (torch.zeros
        # on CPU gets zero pages from the OS lazily), so the current RSS is shown too.
        "rss_now": psutil.Process().memory_info().rss,
    }))


if __name__ == "__main__":
    main()
