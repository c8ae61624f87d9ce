"""A fake OpenAI-compatible streaming server for the trial's tests (no model, no torch).

It behaves like a tiny engine that runs one thing at a time: a prompt's prefill holds the
"engine" for `prefill_s_per_token x prompt length` (so, with --serial, every other stream
stalls meanwhile, like colocated whole-prompt prefill), then each token takes `gap_s`.
Faults are injected by request number: HTTP 500s, truncated answers, streams cut without
[DONE], pauses, failed KV
transfers reported in the final chunk's `splitserve` object.

    python tests/fake_openai_server.py --port 8123 --gap-s 0.01 --fail-every 5
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import time
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse


@dataclass
class FakeBehaviour:
    gap_s: float = 0.01
    prefill_s_per_token: float = 0.0
    serial: bool = False           # prefill blocks every stream (colocated, whole-prompt prefill)
    fail_every: int = 0            # every Nth request answers HTTP 500
    truncate_every: int = 0        # every Nth request stops after half its tokens
    pause_every: int = 0           # every Nth request pauses `pause_s` after its 2nd token
    pause_s: float = 0.3
    kv_report: bool = False        # report a KV transfer per request in the final chunk
    kv_fail_every: int = 0         # every Nth request's KV transfer failed (then recomputed)
    cut_every: int = 0             # every Nth stream ends after 2 tokens without [DONE]
    error_every: int = 0           # every Nth stream sends an error chunk (failed KV transfer) after 1 token
    odd_every: int = 0             # every Nth stream sends a chunk whose `choices` is not a list
    token_ids: bool = False        # honour return_token_ids: each chunk names its token ids
    spawn_child: bool = False      # start a child process, as `serve` starts engines (affinity is inherited)
    adaptive: bool = False         # GET /admin/mix as `serve --adaptive`: one role change at the 5th request
    abort_lag_s: float = 0.0       # a stream the client left still counts as running this long (an abort in flight)


def fake_token(word: str) -> int:
    return sum(word.encode()) % 997 + 3


def build_app(behaviour: FakeBehaviour) -> FastAPI:
    app = FastAPI()
    engine = asyncio.Lock()
    counter = itertools.count(1)
    stats = {"kv_failures": 0, "requests": 0, "running": 0}
    mix = {"roles": {"engine-0": "colocated", "engine-1": "colocated"},
           "decisions": [{"instance_id": None, "reason": "within the hysteresis band", "wall_time": time.time()}]}

    @app.get("/admin/mix")
    async def admin_mix():
        if not behaviour.adaptive:
            return JSONResponse({"error": {"message": "not adaptive"}}, status_code=404)
        return {"enabled": True, "interval_s": 1.0, "targets": {"ttft_s": 2.0, "gap_s": 0.5}, **mix}

    def adapt() -> None:
        if behaviour.adaptive and stats["requests"] == 3:  # the controller reads the shift, holds
            mix["decisions"].append({"instance_id": None, "reason": "cooldown", "ttft_estimate_s": 3.0,
                                     "wall_time": time.time()})
        if behaviour.adaptive and stats["requests"] == 5:
            mix["roles"]["engine-1"] = "prefill"
            mix["decisions"].append({"instance_id": "engine-1", "from_role": "colocated", "to_role": "prefill",
                                     "applied": True, "reason": "prefill is short", "wall_time": time.time()})

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await request.json()
        tokens = [fake_token(w) for w in body["prompt"].split()]
        return {"tokens": tokens, "count": len(tokens)}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(f"# TYPE splitserve_kv_transfer_failures_total counter\n"
                                 f"splitserve_kv_transfer_failures_total {stats['kv_failures']}\n"
                                 f"splitserve_requests_total {stats['requests']}\n"
                                 # the engine gauges coordinator/metrics.py exports: the trial waits on them
                                 f'splitserve_instance_running_requests{{instance="engine-0",role="colocated"}} '
                                 f"{stats['running']}\n"
                                 f'splitserve_instance_queued_requests{{instance="engine-0",role="colocated"}} 0\n')

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        n = next(counter)
        stats["requests"] += 1
        adapt()
        if behaviour.fail_every and n % behaviour.fail_every == 0:
            return JSONResponse({"error": {"message": "injected failure", "type": "server_error"}}, 500)
        prompt = body["prompt"]
        num_prompt = len(prompt) if isinstance(prompt, list) else len(prompt.split())
        max_tokens = int(body.get("max_tokens", 16))
        num_tokens = max_tokens // 2 if behaviour.truncate_every and n % behaviour.truncate_every == 0 else max_tokens
        kv_failed = bool(behaviour.kv_fail_every) and n % behaviour.kv_fail_every == 0
        stats["kv_failures"] += kv_failed
        return StreamingResponse(_counted(_stream(n, num_prompt, num_tokens, kv_failed, body)),
                                 media_type="text/event-stream")

    async def _counted(chunks):
        """The stream counts as running until it ends; one the client left, `abort_lag_s` longer."""
        stats["running"] += 1
        finished = False
        try:
            async for chunk in chunks:
                yield chunk
            finished = True
        finally:
            if finished or not behaviour.abort_lag_s:
                stats["running"] -= 1
            else:
                asyncio.get_running_loop().call_later(behaviour.abort_lag_s, lambda: stats.update(
                    running=stats["running"] - 1))

    async def _stream(n, num_prompt, num_tokens, kv_failed, body):
        def sse(obj) -> bytes:
            return f"data: {json.dumps(obj)}\n\n".encode()

        async with engine:
            await asyncio.sleep(behaviour.prefill_s_per_token * num_prompt)
        for i in range(num_tokens):
            if behaviour.serial:
                async with engine:  # wait while someone's prefill holds the engine
                    pass
            await asyncio.sleep(behaviour.gap_s if i else 0.0)
            if behaviour.pause_every and n % behaviour.pause_every == 0 and i == 2:
                await asyncio.sleep(behaviour.pause_s)
            if behaviour.cut_every and n % behaviour.cut_every == 0 and i == 2:
                return  # the connection closes mid-answer
            if behaviour.error_every and n % behaviour.error_every == 0 and i == 1:
                yield sse({"error": {"message": "KV transfer failed", "type": "server_error"},
                           "splitserve": {"kv_transfer": {"bytes": 0, "seconds": 0.5, "outcome": "failed",
                                                          "retries": 2}}})
                yield b"data: [DONE]\n\n"
                return
            if behaviour.odd_every and n % behaviour.odd_every == 0 and i == 1:
                yield sse({"id": f"cmpl-{n}", "choices": "not a list"})
            last = i == num_tokens - 1
            choice = {"index": 0, "text": f" t{i}", "finish_reason": "length" if last else None}
            if behaviour.token_ids and body.get("return_token_ids"):
                choice["token_ids"] = [100 + i]
            yield sse({"id": f"cmpl-{n}", "object": "text_completion", "model": "fake-model",
                       "choices": [choice]})
        final = {"id": f"cmpl-{n}", "object": "text_completion", "model": "fake-model", "choices": []}
        if body.get("stream_options", {}).get("include_usage"):
            final["usage"] = {"prompt_tokens": num_prompt, "completion_tokens": num_tokens,
                              "total_tokens": num_prompt + num_tokens}
        if behaviour.kv_report:
            final["splitserve"] = {"kv_transfer": {"bytes": 1000 * num_prompt, "seconds": 0.001,
                                                   "outcome": "failed" if kv_failed else "ok",
                                                   "retries": 1 if kv_failed else 0}}
        yield sse(final)
        yield b"data: [DONE]\n\n"

    return app


def main() -> None:
    import uvicorn

    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    for name, value in FakeBehaviour().__dict__.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            p.add_argument(flag, action="store_true")
        else:
            p.add_argument(flag, type=type(value), default=value)
    args = vars(p.parse_args())
    port = args.pop("port")
    if args["spawn_child"]:
        import subprocess
        import sys

        # the child lives in our process group, so stopping the group stops it too
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", "--engine-id", "fake-engine"])
    uvicorn.run(build_app(FakeBehaviour(**args)), host="127.0.0.1", port=port, log_level="warning")


if __name__ == "__main__":
    main()
