"""Frontend benchmark: what the CPU frontend costs a request.

1. render + tokenize throughput for ~2k-token chats on one core (target >= 100 req/s),
   against transformers' own `apply_chat_template(tokenize=True)` on the same chats;
2. time to first token and per-token time through the whole serving path (HTTP + SSE,
   frontend process, ZeroMQ, engine process) against calling EngineCore in-process with the
   same prompts, one request at a time (targets: <= 5 ms added to TTFT at p50, <= 1 ms per
   token). Both sides use 1 torch thread; prompts are distinct random token ids, so no side
   gets prefix-cache hits the other does not.

    .venv/bin/python bench/frontend.py                      # bundled SmolLM2-135M
    .venv/bin/python bench/frontend.py --model tiny         # tiny random model: overhead only
    .venv/bin/python bench/frontend.py --skip-serving       # part 1 only
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

WORDS = ("the model reads a long conversation about serving systems, caches, queues and latency; "
         "it answers with care — naïve café ünïcode 中文 ✓. ").split(" ")


def two_k_chat(seed: int, target_tokens: int, renderer) -> list[dict]:
    rng = random.Random(seed)
    messages = [{"role": "system", "content": "You are a careful assistant."}]
    while len(renderer.render_chat(messages).token_ids) < target_tokens:
        role = "user" if messages[-1]["role"] != "user" else "assistant"
        messages.append({"role": role, "content": " ".join(rng.choice(WORDS) for _ in range(120))})
    if messages[-1]["role"] != "user":
        messages.append({"role": "user", "content": "Summarize."})
    return messages


def bench_render(model: str | None, seconds: float) -> dict:
    from splitserve.api.render import Renderer
    from splitserve.models.loader import load_tokenizer

    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core
    tokenizer, template = load_tokenizer(model)
    renderer = Renderer(tokenizer, template)
    chats = [two_k_chat(seed, 2048, renderer) for seed in range(16)]
    lengths = [len(renderer.render_chat(c).token_ids) for c in chats]

    def rate(fn) -> tuple[float, float]:
        """-> (requests per wall second, requests per CPU second of this process)."""
        n, start, cpu_start = 0, time.perf_counter(), time.process_time()
        while time.perf_counter() - start < seconds:
            fn(chats[n % len(chats)])
            n += 1
        return n / (time.perf_counter() - start), n / (time.process_time() - cpu_start)

    ours = rate(lambda c: renderer.render_chat(c))
    hf = rate(lambda c: tokenizer.apply_chat_template(c, tokenize=True, add_generation_prompt=True))
    # On a shared machine the wall rate counts other processes' time on our core; the CPU rate
    # is what one dedicated core does.
    return {"prompt_tokens_mean": statistics.mean(lengths), "load_average_1m": os.getloadavg()[0],
            "render_tokenize_req_per_s_wall": ours[0], "render_tokenize_req_per_cpu_s": ours[1],
            "hf_apply_chat_template_req_per_s_wall": hf[0], "hf_apply_chat_template_req_per_cpu_s": hf[1]}


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(n)]


class InProcess:
    """EngineCore called directly: the baseline with no frontend at all."""

    def __init__(self, model: str | None) -> None:
        import torch

        from splitserve.config import CacheConfig, EngineConfig
        from splitserve.engine.core import EngineCore

        torch.set_num_threads(1)
        self.core = EngineCore(EngineConfig(model=model, num_threads=1,
                                            cache=CacheConfig(kv_cache_memory="256MiB")))
        self.n, self.cpu_s = 0, 0.0

    def run(self, prompt: list[int], max_tokens: int) -> tuple[float, float]:
        """-> (time to first token, mean time per later token), seconds."""
        from splitserve.sampling import SamplingParams

        self.n += 1
        cpu_start = time.process_time()
        start, first = time.perf_counter(), None
        self.core.add_request(f"r{self.n}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                   ignore_eos=True))
        while self.core.has_unfinished_requests():
            if self.core.step() and first is None:
                first = time.perf_counter()
        self.cpu_s += time.process_time() - cpu_start
        return first - start, (time.perf_counter() - first) / (max_tokens - 1)


class ThroughServer:
    """The same request over HTTP/SSE through `splitserve serve` (frontend + 1 engine process)."""

    def __init__(self, model: str | None, log_path: Path) -> None:
        import httpx

        from serve_support import ServerProcess

        extra = ["--kv-cache-memory", "256MiB"] + (["--model", model] if model else [])
        self.server = ServerProcess(None, *extra, log_path=log_path).wait_ready(600)
        self.client = httpx.Client(timeout=120)
        engine_pid = self.server.health()["instances"][0]["pid"]
        self.processes = {"frontend": psutil.Process(self.server.proc.pid), "engine": psutil.Process(engine_pid)}

    def cpu_s(self) -> dict[str, float]:
        return {name: sum(p.cpu_times()[:2]) for name, p in self.processes.items()}

    def run(self, prompt: list[int], max_tokens: int) -> tuple[float, float]:
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
        start, first = time.perf_counter(), None
        with self.client.stream("POST", self.server.base_url + "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if first is None and line.startswith("data: {"):
                    first = time.perf_counter()
        return first - start, (time.perf_counter() - first) / (max_tokens - 1)

    def close(self) -> None:
        self.client.close()
        self.server.stop()


def bench_serving(model: str | None, prompts, max_tokens: int, log_path: Path) -> dict:
    """Alternates the two sides request by request, so both see the same machine load."""
    server = ThroughServer(model, log_path)
    try:
        local = InProcess(model)
        local.run(prompts[0], max_tokens), server.run(prompts[0], max_tokens)  # warm-up
        local.cpu_s, server_cpu_start = 0.0, server.cpu_s()
        pairs = [(local.run(p, max_tokens), server.run(p, max_tokens)) for p in prompts]
        server_cpu = {k: v - server_cpu_start[k] for k, v in server.cpu_s().items()}
    finally:
        server.close()
    n, tokens = len(prompts), len(prompts) * max_tokens
    # CPU time is what the frontend costs regardless of how busy the machine is.
    cpu = {"frontend_cpu_ms_per_request": 1e3 * server_cpu["frontend"] / n,
           "frontend_cpu_ms_per_token": 1e3 * server_cpu["frontend"] / tokens,
           "engine_process_cpu_ms_per_request": 1e3 * server_cpu["engine"] / n,
           "in_process_engine_cpu_ms_per_request": 1e3 * local.cpu_s / n}
    ttft_in, ttft_srv = [a[0] for a, _ in pairs], [b[0] for _, b in pairs]
    tok_in, tok_srv = [a[1] for a, _ in pairs], [b[1] for _, b in pairs]
    return {
        "ttft_in_process": summary(ttft_in), "ttft_through_frontend": summary(ttft_srv),
        "per_token_in_process": summary(tok_in), "per_token_through_frontend": summary(tok_srv),
        "ttft_added_p50_ms": 1e3 * (statistics.median(ttft_srv) - statistics.median(ttft_in)),
        "per_token_added_p50_ms": 1e3 * (statistics.median(tok_srv) - statistics.median(tok_in)),
        "ttft_added_paired_p50_ms": 1e3 * statistics.median(b - a for a, b in zip(ttft_in, ttft_srv)),
        "per_token_added_paired_p50_ms": 1e3 * statistics.median(b - a for a, b in zip(tok_in, tok_srv)),
        **cpu,
    }


def summary(values: list[float]) -> dict:
    values = sorted(values)
    return {"p50_ms": 1e3 * statistics.median(values), "p90_ms": 1e3 * values[int(0.9 * (len(values) - 1))],
            "mean_ms": 1e3 * statistics.mean(values)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model path; 'tiny' writes a tiny random checkpoint")
    p.add_argument("--requests", type=int, default=20)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--render-seconds", type=float, default=5.0)
    p.add_argument("--skip-serving", action="store_true")
    p.add_argument("--json", type=Path, default=None, help="write the results here too")
    args = p.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    model = args.model
    tmp = Path(tempfile.mkdtemp(prefix="bench-frontend-"))
    if model == "tiny":
        from tiny_models import write_tiny_checkpoint

        model = str(write_tiny_checkpoint(tmp / "tiny", tokenizer="smollm"))

    results: dict = {"model": args.model or "bundled SmolLM2-135M-Instruct Q4_1",
                     "cpus": os.cpu_count(), "load_average_1m_at_start": os.getloadavg()[0]}
    if not args.skip_serving:
        from splitserve.models.loader import load_tokenizer

        vocab = len(load_tokenizer(model)[0])
        prompts = random_prompts(args.requests, args.prompt_tokens, vocab)
        results["serving"] = {"prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
                              "requests": args.requests,
                              **bench_serving(model, prompts, args.max_tokens, tmp / "server.log")}
    results["render"] = bench_render(model, args.render_seconds)  # last: it pins this process to one core
    print(json.dumps(results, indent=2))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
