"""Fuzz: generated OpenAI request bodies against a live server; counts 5xx, then checks nothing leaked.

    .venv/bin/python bench/fuzz.py [--count 10000] [--seconds 1800] [--arrangement colocated|split|both]
                                   [--model PATH] [--seed 0] [--concurrency 8] [--json out.json]

Starts `splitserve serve` on loopback (a tiny random-weight model unless --model; `--model bundled`
for the real one), one per arrangement (colocated: one engine; split: one prefill + one decode),
and sends `count` bodies (stopping early at `seconds`) to every endpoint that takes a body:
all OpenAI fields and splitserve's extensions, numbers at their limits and one past them,
odd unicode (lone surrogates, NUL, bidi marks, astral planes), nested junk, broken JSON,
wrong types, and now and then a repeated X-Request-Id. Streams are read to the end. Then it
waits for the server to settle and reads back from /metrics: KV blocks in use, tokens the
router still holds, blocks held for a handover and transfers in flight must all be zero, and
a plain request must still get its answer. Exit status 1 on any 5xx, leak or failed check.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

import httpx  # noqa: E402

from splitserve.api.openai_schema import (ChatCompletionRequest, CompletionRequest,  # noqa: E402
                                               numeric_bounds)

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize", "/v1/chat/completions/render")
ODD_TEXT = ["", " ", "hello", "\u0000", "\ud800", "\udfff", "\u202e\u202d", "\u200d\u200b", "\U0001f600" * 3,
            "\U0010ffff", "a\r\nb", "<|im_start|>", "<|im_end|>assistant", "{{ 7*7 }}", "{% for %}", "\\u0000",
            "é" * 50, "中文" * 20, "🏳️‍🌈", "\x7f\x1b[31m", "%s%n", "' OR 1=1 --", "null", "A" * 3000]
ROLES = ["user", "system", "assistant", "developer", "tool", "root", "", None, 5, ["user"]]
STRING_FIELDS = ["model", "user", "suffix", "stop"]
BOOL_FIELDS = ["stream", "ignore_eos", "echo", "add_generation_prompt", "return_token_ids", "add_special_tokens",
               "logprobs"]


def _numbers(rng: random.Random, low, high) -> object:
    edge = [low, high, 0, 1, -1, 2**31 - 1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 10**30, -(2**63),
            -(2**63) - 1, 1e308, -1e308, 5e-324, 0.5, 1.5, 2.000001]
    if low is not None:
        edge += [low - 1 if isinstance(low, int) else low - 1e-6]
    if high is not None:
        edge += [high + 1 if isinstance(high, int) else high + 1e-6]
    return rng.choice(edge)


def junk(rng: random.Random, depth: int = 0) -> object:
    kind = rng.randrange(9 if depth < 4 else 6)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.choice([0, -1, 1, 2**64, -(2**63) - 1, 10**40, 3.25, -0.0, 1e308])
    if kind in (3, 4, 5):
        return rng.choice(ODD_TEXT)
    if kind in (6, 7):
        return [junk(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {rng.choice(["role", "content", "type", "text", "a", "include_usage", ""]): junk(rng, depth + 1)
            for _ in range(rng.randrange(4))}


def message(rng: random.Random) -> object:
    if rng.random() < 0.1:
        return junk(rng)
    content = rng.choice([rng.choice(ODD_TEXT), None, [{"type": "text", "text": rng.choice(ODD_TEXT)}],
                          [{"type": "image_url", "image_url": {"url": "x"}}], junk(rng)])
    msg = {"role": rng.choice(ROLES) if rng.random() < 0.2 else rng.choice(["user", "system", "assistant"]),
           "content": content}
    if rng.random() < 0.1:
        msg[rng.choice(["name", "tool_calls", "tool_call_id"])] = junk(rng)
    return msg


def near_valid(rng: random.Random, endpoint: str) -> dict:
    """A body the server should answer with 200, but with numbers at their accepted limits, odd
    text and optional fields set: these are the ones that reach the engines."""
    schema = ChatCompletionRequest if "chat" in endpoint else CompletionRequest
    text = rng.choice(ODD_TEXT[:-1]) + rng.choice(ODD_TEXT[:-1])
    if "chat" in endpoint or endpoint == "/tokenize":
        out = {"messages": [{"role": rng.choice(["system", "user"]), "content": text}]}
    elif endpoint == "/detokenize":
        return {"tokens": [rng.randrange(300) for _ in range(rng.randrange(1, 20))]}
    else:
        out = {"prompt": text or [rng.randrange(1, 300) for _ in range(rng.randrange(1, 30))]}
    bounds = numeric_bounds(schema)
    for name in rng.sample(sorted(bounds), k=3):
        low, high = bounds[name]
        if name not in ("n", "top_logprobs", "max_tokens", "max_completion_tokens", "min_tokens"):
            out[name] = rng.choice([low, high])
    out.update(max_tokens=rng.choice([1, 3, 8]), stream=rng.random() < 0.4, ignore_eos=rng.random() < 0.5)
    if rng.random() < 0.3:
        out["stop"] = [rng.choice(ODD_TEXT[:-1]) for _ in range(rng.randrange(1, 5))]
    if rng.random() < 0.2:
        out["stream_options"] = {"include_usage": True}
    if rng.random() < 0.2:
        out["return_token_ids"] = True
    return out


def body(rng: random.Random, endpoint: str) -> dict | bytes:
    """One request body: half near-valid (reaches the engines), half with fields past their limits."""
    if rng.random() < 0.5:
        return near_valid(rng, endpoint)
    if rng.random() < 0.1:
        return rng.choice([b"", b"{", b"[]", b"null", b'{"prompt": "\xff\xfe"}', b'{"a":' * 200,
                           b'{"prompt": "x"} trailing', "{\"prompt\": \"\ud800\"}".encode("utf-8", "surrogatepass")])
    schema = ChatCompletionRequest if "chat" in endpoint else CompletionRequest
    out: dict = {}
    if "chat" in endpoint or (endpoint == "/tokenize" and rng.random() < 0.5):
        out["messages"] = [message(rng) for _ in range(rng.randrange(0, 4) or 1)]
    elif endpoint == "/detokenize":
        out["tokens"] = rng.choice([[1, 2, 3], [], [-1], [2**63], [0] * 100, junk(rng)])
    else:
        out["prompt"] = rng.choice([rng.choice(ODD_TEXT), [1, 2, 3], [[1, 2]], ["a", "b"], [], [-1], [2**64],
                                    [10**6], junk(rng)])
    out["max_tokens"] = rng.choice([1, 2, 4, 8])  # keeps valid requests short; overridden below at times
    for name, (low, high) in numeric_bounds(schema).items():
        if rng.random() < 0.15:
            out[name] = _numbers(rng, low, high)
    for name in STRING_FIELDS + BOOL_FIELDS:
        if rng.random() < 0.08:
            out[name] = rng.choice([rng.choice(ODD_TEXT), rng.choice([True, False]), junk(rng)])
    if rng.random() < 0.1:
        out["stop"] = [rng.choice(ODD_TEXT) for _ in range(rng.randrange(20))]
    if rng.random() < 0.1:
        out["stop_token_ids"] = rng.choice([[0], [2**63], list(range(70)), junk(rng)])
    if rng.random() < 0.1:
        out["stream_options"] = rng.choice([{"include_usage": True}, {"include_usage": "yes"}, junk(rng)])
    if rng.random() < 0.1:
        out["tools"] = rng.choice([[{"type": "function", "function": {"name": "f", "parameters": {}}}], junk(rng)])
    if rng.random() < 0.05:
        out[rng.choice(ODD_TEXT) or "x"] = junk(rng)
    if "max_tokens" in out and isinstance(out["max_tokens"], int) and out["max_tokens"] > 64 \
            and rng.random() < 0.5:
        out["max_tokens"] = 8  # a valid huge max_tokens would decode until the context is full
    return out


async def send(client: httpx.AsyncClient, endpoint: str, payload, request_id: str | None) -> tuple[int, str]:
    headers = {"content-type": "application/json"}
    if request_id:
        headers["x-request-id"] = request_id
    content = payload if isinstance(payload, bytes) else json.dumps(payload).encode("utf-8", "surrogatepass")
    streaming = isinstance(payload, dict) and payload.get("stream") is True
    if streaming:
        async with client.stream("POST", endpoint, content=content, headers=headers) as r:
            text = b"".join([chunk async for chunk in r.aiter_bytes()]).decode("utf-8", "replace")
            return r.status_code, text[-300:]
    r = await client.post(endpoint, content=content, headers=headers)
    return r.status_code, r.text[:300]


async def fuzz(base_url: str, count: int, seconds: float, seed: int, concurrency: int) -> dict:
    rng = random.Random(seed)
    statuses: dict[int, int] = {}
    by_endpoint: dict[str, dict[int, int]] = {e: {} for e in ENDPOINTS}
    server_errors: list[dict] = []
    ids = [f"fuzz-{i}" for i in range(20)]
    deadline = time.monotonic() + seconds
    queue: asyncio.Queue = asyncio.Queue()
    for _ in range(count):
        endpoint = rng.choice(ENDPOINTS)
        request_id = rng.choice(ids) if rng.random() < 0.1 else None  # X-Request-Id reuse
        queue.put_nowait((endpoint, body(rng, endpoint), request_id))
    sent = 0

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal sent
        while not queue.empty() and time.monotonic() < deadline:
            endpoint, payload, request_id = queue.get_nowait()
            try:
                status, text = await send(client, endpoint, payload, request_id)
            except httpx.HTTPError as e:
                status, text = 599, f"{type(e).__name__}: {e}"  # a hang-up or a timeout counts as a failure
            sent += 1
            statuses[status] = statuses.get(status, 0) + 1
            by_endpoint[endpoint][status] = by_endpoint[endpoint].get(status, 0) + 1
            in_stream_5xx = status == 200 and '"type":"server_error"' in text.replace(" ", "")  # an SSE error event
            if status >= 500 or in_stream_5xx:
                server_errors.append({"endpoint": endpoint, "status": status, "answer": text,
                                      "body": payload if isinstance(payload, dict) else repr(payload)[:300]})

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return {"sent": sent, "statuses": dict(sorted(statuses.items())), "by_endpoint": by_endpoint,
            "num_5xx": sum(n for s, n in statuses.items() if s >= 500), "server_errors": server_errors[:10]}


def leftovers(base_url: str) -> dict:
    """What the server still holds once idle: every value must be 0."""
    from serve_support import metric_samples

    out = {}
    for name in ("splitserve_instance_kv_blocks_used", "splitserve_instance_outstanding_tokens",
                 "splitserve_kv_held_blocks", "splitserve_kv_transfers_in_flight",
                 "splitserve_instance_running_requests", "splitserve_instance_queued_requests"):
        out[name] = sum(metric_samples(base_url, name).values())
    return out


def check_server(base_url: str, settle_s: float = 60.0) -> dict:
    from serve_support import wait_until

    wait_until(lambda: not any(leftovers(base_url).values()), timeout_s=settle_s, interval_s=0.5)
    held = leftovers(base_url)
    r = httpx.post(base_url + "/v1/completions", json={"prompt": "hello", "max_tokens": 3, "ignore_eos": True},
                   timeout=60)
    health = httpx.get(base_url + "/health", timeout=10)
    return {"leftovers": held, "leaked": any(held.values()), "health": health.status_code,
            "answers_normally": r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3}


def start_server(arrangement: str, model: str | None, root: Path):
    import os
    import subprocess

    from serve_support import REPO as SERVE_CWD
    from serve_support import ServerProcess, free_port
    from tiny_models import write_tiny_checkpoint

    class FuzzServer(ServerProcess):
        def __init__(self, flags: list[str]) -> None:  # noqa: D401 -- ServerProcess with free-form flags
            self.port = free_port()
            self.base_url = f"http://127.0.0.1:{self.port}"
            self.log_path = root / f"{arrangement}.log"
            self._log = open(self.log_path, "wb")
            cmd = [sys.executable, "-m", "splitserve.cli", "serve", "--port", str(self.port), "--log-level",
                   "warning", "--threads-per-instance", "1", *flags]
            self.proc = subprocess.Popen(cmd, cwd=SERVE_CWD, stdout=self._log, stderr=subprocess.STDOUT,
                                         env={**os.environ, "OMP_NUM_THREADS": "1"})

    flags = ["--prefill", "1", "--decode", "1"] if arrangement == "split" else ["--instances", "1"]
    flags += ["--max-num-seqs", "8", "--max-request-bytes", str(1 << 20), "--kv-cache-memory", "64MiB"]
    if model is None:
        flags += ["--model", str(write_tiny_checkpoint(root / "tiny", arch="llama"))]
    elif model != "bundled":
        flags += ["--model", model]
    return FuzzServer(flags).wait_ready(timeout_s=600)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--count", type=int, default=10_000)
    p.add_argument("--seconds", type=float, default=1800.0, help="stop sending after this long (per arrangement)")
    p.add_argument("--arrangement", choices=("colocated", "split", "both"), default="both")
    p.add_argument("--model", default=None, help="a model path, or 'bundled'; default: a tiny random-weight model")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    import tempfile

    report, ok = {}, True
    arrangements = ("colocated", "split") if args.arrangement == "both" else (args.arrangement,)
    with tempfile.TemporaryDirectory(prefix="splitserve-fuzz-") as tmp:
        for arrangement in arrangements:
            server = start_server(arrangement, args.model, Path(tmp))
            try:
                start = time.monotonic()
                result = asyncio.run(fuzz(server.base_url, args.count, args.seconds, args.seed, args.concurrency))
                result["seconds"] = round(time.monotonic() - start, 1)
                result.update(check_server(server.base_url))
            finally:
                result["exit_code"] = server.stop()
            report[arrangement] = result
            ok &= (result["num_5xx"] == 0 and not result["leaked"] and result["answers_normally"]
                   and result["health"] == 200)
            print(f"{arrangement}: {result['sent']} bodies in {result['seconds']} s, statuses {result['statuses']}, "
                  f"5xx {result['num_5xx']}, leftovers {result['leftovers']}, answers normally "
                  f"{result['answers_normally']}", flush=True)
            for error in result["server_errors"][:3]:
                print("  5xx:", json.dumps(error)[:600], flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
