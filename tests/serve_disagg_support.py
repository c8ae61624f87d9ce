"""Start a real `splitserve serve --prefill N --decode M` (or a colocated one) for the disaggregation tests."""
from __future__ import annotations

import asyncio
import sys
import threading
import time
from pathlib import Path

import httpx

from serve_support import ServerProcess


class DisaggServer(ServerProcess):
    """ServerProcess with any arrangement flags (`--prefill 1 --decode 1 ...` or `--instances 1`)."""

    def __init__(self, model: str, *arrangement: str, log_path: Path | None = None) -> None:
        super().__init__(model, *arrangement, log_path=log_path)

    def command(self, port: int) -> list[str]:
        return [sys.executable, "-m", "splitserve.cli", "serve", "--port", str(port), "--model", self.model,
                "--threads-per-instance", "1", "--log-level", "warning", "--kv-cache-memory", "8MiB",
                "--max-num-batched-tokens", "128", *self.extra]


def completion_body(prompt: list[int], max_tokens: int, stream: bool, **extra) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream, "stream_options": {"include_usage": True} if stream else None, **extra}


async def stream_completion(client: httpx.AsyncClient, base_url: str, body: dict, leave_after: int | None = None
                            ) -> dict:
    """Reads one SSE completion. Returns {"text", "num_tokens", "finish", "report", "error", "done",
    "chunks"}; with leave_after, closes the connection after that many content chunks."""
    result = {"text": "", "num_tokens": None, "finish": None, "report": None, "error": None, "done": False,
              "chunks": 0, "status": None}
    async with client.stream("POST", base_url + "/v1/completions", json=body) as resp:
        result["status"] = resp.status_code
        if resp.status_code != 200:
            payload = (await resp.aread()).decode()
            result["error"] = payload
            return result
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                result["done"] = True
                break
            chunk = httpx.Response(200, content=line[6:]).json()
            result["report"] = chunk.get("splitserve", result["report"])
            if "error" in chunk:
                result["error"] = chunk["error"]
                continue
            for choice in chunk.get("choices") or []:
                result["text"] += choice.get("text") or ""
                result["finish"] = choice.get("finish_reason") or result["finish"]
                result["chunks"] += 1
            if chunk.get("usage"):
                result["num_tokens"] = chunk["usage"]["completion_tokens"]
            if leave_after is not None and result["chunks"] >= leave_after:
                break  # leaving the `async with` closes the connection: a client disconnect
    return result


def run(coro):
    return asyncio.run(coro)


class SteadyLoad:
    """`clients` clients streaming `body` one after another, in a thread, until stopped; every result
    is kept with its start and end. A request that raises an httpx error is recorded by `failed`
    (override it to tell kinds of failure apart); `join_s` bounds the wait for the clients at exit."""

    join_s = 180.0

    def __init__(self, base_url: str, clients: int, body: dict) -> None:
        self.base_url, self.clients, self.body, self.results = base_url, clients, body, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def failed(self, e: httpx.HTTPError) -> dict:
        return {"error": repr(e), "done": False, "text": None}

    async def _run(self) -> None:
        async with httpx.AsyncClient(timeout=120) as client:
            async def one_client() -> None:
                while not self._stop.is_set():
                    started = time.monotonic()
                    try:
                        result = await stream_completion(client, self.base_url, self.body)
                    except httpx.HTTPError as e:
                        result = self.failed(e)
                    self.results.append({**result, "started": started, "ended": time.monotonic()})
            await asyncio.gather(*(one_client() for _ in range(self.clients)))

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=self.join_s)
