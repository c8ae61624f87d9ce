"""Load generation and process watching for the overload and soak scripts (and their short tests).

    ProcessWatch(pid)       samples RSS, open fds and threads of a server and its children
    open_loop(...)          sends requests at a fixed rate for a while, never more than a cap in flight
    one_request(...)        one completion (stream or not), optionally abandoned mid-way
    latency_probe(...)      sequential requests: the latency of an idle server
    serve_and_report(...)   a server in a temporary folder, one measurement, the report as JSON

All traffic goes to the base URL it is given (loopback in every script here); every loop is
bounded by a duration and a cap on requests in flight.
"""
from __future__ import annotations

import asyncio
import json
import random
import re
import statistics
import threading
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil


@dataclass
class ProcessSample:
    rss_bytes: dict[int, int]
    num_fds: dict[int, int]
    num_threads: dict[int, int]


def sample_tree(pid: int) -> ProcessSample:
    """RSS, fds and threads of a process and every descendant (vanished ones are skipped)."""
    rss, fds, threads = {}, {}, {}
    try:
        root = psutil.Process(pid)
        procs = [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        return ProcessSample({}, {}, {})
    for p in procs:
        try:
            with p.oneshot():
                rss[p.pid], fds[p.pid], threads[p.pid] = p.memory_info().rss, p.num_fds(), p.num_threads()
        except psutil.Error:
            continue
    return ProcessSample(rss, fds, threads)


class ProcessWatch:
    """Samples a process tree every `interval_s` on a thread; keeps the peak RSS of each process."""

    def __init__(self, pid: int, interval_s: float = 0.25) -> None:
        self.pid, self.interval_s = pid, interval_s
        self.peak_rss: dict[int, int] = {}
        self.names: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            sample = sample_tree(self.pid)
            for pid, rss in sample.rss_bytes.items():
                self.peak_rss[pid] = max(rss, self.peak_rss.get(pid, 0))
                if pid not in self.names:
                    try:
                        cmd = psutil.Process(pid).cmdline()
                        engine = next((cmd[i + 1] for i, a in enumerate(cmd[:-1]) if a == "--engine-id"), None)
                        self.names[pid] = f"engine {engine}" if engine else "frontend"
                    except psutil.Error:
                        self.names[pid] = str(pid)
            self._stop.wait(self.interval_s)

    def __enter__(self) -> ProcessWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def peak_by_name_mib(self) -> dict[str, float]:
        return {self.names.get(pid, str(pid)): round(rss / 2**20, 1) for pid, rss in self.peak_rss.items()}


@dataclass
class Outcome:
    status: int | None  # HTTP status; None: no answer (connection error, timeout, abandoned)
    kind: str  # ok | rejected (429/503) | client_error | server_error | timeout | abandoned | error
    seconds: float
    ttft_s: float | None = None
    retry_after: str | None = None
    num_tokens: int = 0


async def one_request(client: httpx.AsyncClient, base_url: str, body: dict, timeout_s: float,
                      leave_after_chunks: int | None = None, headers: dict | None = None) -> Outcome:
    """One /v1/completions request. With leave_after_chunks, the client hangs up after that many
    streamed chunks (or, non-streaming, after that many tenths of a second)."""
    start = time.monotonic()
    ttft, tokens = None, 0
    try:
        if not body.get("stream"):
            timeout = timeout_s if leave_after_chunks is None else 0.1 * leave_after_chunks
            r = await client.post(base_url + "/v1/completions", json=body, timeout=timeout, headers=headers)
            kind = kind_of(r.status_code)
            if r.status_code == 200:
                tokens = r.json()["usage"]["completion_tokens"]
            return Outcome(r.status_code, kind, time.monotonic() - start, None, r.headers.get("retry-after"), tokens)
        async with client.stream("POST", base_url + "/v1/completions", json=body, timeout=timeout_s,
                                 headers=headers) as r:
            if r.status_code != 200:
                await r.aread()
                return Outcome(r.status_code, kind_of(r.status_code), time.monotonic() - start, None,
                               r.headers.get("retry-after"))
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                if '"error"' in line:
                    return Outcome(200, "error", time.monotonic() - start, ttft)
                ttft = ttft if ttft is not None else time.monotonic() - start
                tokens += 1
                if leave_after_chunks is not None and tokens >= leave_after_chunks:
                    return Outcome(200, "abandoned", time.monotonic() - start, ttft, None, tokens)
        return Outcome(200, "ok", time.monotonic() - start, ttft, None, tokens)
    except httpx.TimeoutException:
        return Outcome(None, "abandoned" if leave_after_chunks is not None else "timeout", time.monotonic() - start)
    except httpx.HTTPError:
        return Outcome(None, "error", time.monotonic() - start)


def kind_of(status: int) -> str:
    if status == 200:
        return "ok"
    if status in (429, 503):
        return "rejected"
    return "client_error" if status < 500 else "server_error"


@dataclass
class LoadResult:
    outcomes: list[Outcome] = field(default_factory=list)
    offered: int = 0
    seconds: float = 0.0
    max_in_flight: int = 0
    max_queued: dict[str, float] = field(default_factory=dict)  # engine -> most queued requests seen

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for o in self.outcomes:
            out[o.kind] = out.get(o.kind, 0) + 1
        return out

    def rejected_without_retry_after(self) -> int:
        return sum(1 for o in self.outcomes if o.kind == "rejected" and not o.retry_after)


def queued_by_instance(base_url: str, client: httpx.Client) -> dict[str, float]:
    out = {}
    for line in client.get(base_url + "/metrics", timeout=5).text.splitlines():
        if line.startswith("splitserve_instance_queued_requests{"):
            out[re.search(r'instance="([^"]+)"', line).group(1)] = float(line.rsplit(" ", 1)[1])
    return out


async def open_loop(base_url: str, rate_per_s: float, duration_s: float, make_request, timeout_s: float = 60.0,
                    max_in_flight: int = 512) -> LoadResult:
    """Starts `make_request(i) -> (body, leave_after_chunks[, headers])` at `rate_per_s` for `duration_s`,
    waits for all of them, and polls the engines' queue lengths meanwhile."""
    result = LoadResult()
    in_flight: set[asyncio.Task] = set()
    limits = httpx.Limits(max_connections=max_in_flight, max_keepalive_connections=64)
    metrics_client = httpx.Client()

    async def poll_queues() -> None:
        while True:
            try:
                queued = await asyncio.to_thread(queued_by_instance, base_url, metrics_client)
            except httpx.HTTPError:
                queued = {}
            for k, v in queued.items():
                result.max_queued[k] = max(v, result.max_queued.get(k, 0))
            await asyncio.sleep(0.5)

    async with httpx.AsyncClient(limits=limits) as client:
        poller = asyncio.create_task(poll_queues())
        start, i = time.monotonic(), 0
        while (now := time.monotonic()) - start < duration_s:
            due = int((now - start) * rate_per_s) + 1
            while i < due and len(in_flight) < max_in_flight:
                body, leave, *headers = make_request(i)
                task = asyncio.create_task(one_request(client, base_url, body, timeout_s, leave, *headers))
                in_flight.add(task)
                task.add_done_callback(lambda t: (in_flight.discard(t), result.outcomes.append(t.result())))
                i += 1
            result.max_in_flight = max(result.max_in_flight, len(in_flight))
            await asyncio.sleep(0.005)
        result.offered, result.seconds = i, time.monotonic() - start
        if in_flight:
            await asyncio.wait(set(in_flight), timeout=timeout_s + 10)
        poller.cancel()
    metrics_client.close()
    return result


async def latency_probe(base_url: str, body: dict, n: int = 8, timeout_s: float = 60.0) -> float:
    """Median end-to-end seconds of `n` requests sent one after another."""
    async with httpx.AsyncClient() as client:
        times = [(await one_request(client, base_url, body, timeout_s)).seconds for _ in range(n)]
    return statistics.median(times)


async def closed_loop_rate(base_url: str, body: dict, concurrency: int, duration_s: float) -> float:
    """Completed requests per second with `concurrency` clients each sending back to back: the
    sustainable rate."""
    done = 0
    deadline = time.monotonic() + duration_s

    async def worker(client):
        nonlocal done
        while time.monotonic() < deadline:
            if (await one_request(client, base_url, body, 60.0)).kind == "ok":
                done += 1

    start = time.monotonic()
    async with httpx.AsyncClient() as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return done / (time.monotonic() - start)


def random_completion(rng: random.Random, max_prompt_words: int = 40, max_tokens: tuple[int, int] = (4, 48),
                      stream_share: float = 0.7) -> dict:
    words = " ".join(rng.choice(("hello", "world", "the", "answer", "is", "forty", "two")) for _ in
                     range(rng.randint(1, max_prompt_words)))
    stream = rng.random() < stream_share
    return {"prompt": words, "max_tokens": rng.randint(*max_tokens), "ignore_eos": True, "temperature": 0,
            "stream": stream}


def serve_and_report(start, measure, json_path: Path | None) -> dict:
    """start(folder) -> a ready server; measure(server) -> a coroutine returning the report.
    The server always stops; the report is printed (and written to json_path) as JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        srv = start(Path(tmp))
        try:
            report = asyncio.run(measure(srv))
        finally:
            srv.stop()
    text = json.dumps(report, indent=2)
    print(text)
    if json_path:
        json_path.write_text(text + "\n")
    return report
