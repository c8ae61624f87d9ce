"""Frontend scale-out: short chats per second and streamed tokens per second through the HTTP API
with 1 and 2 API processes (`serve --api-server-count N`), in one run.

The engine serves the tiny random-weight model (tests/tiny_models.py: a few hundred-token
vocabulary, two small layers), so a step costs little and the frontend -- HTTP, validation,
chat template, tokenize, detokenize, JSON and SSE -- is what limits the rate. For each N:
start the server (one engine with 1 torch thread), warm up, then

  short chats: C clients, each on its own keep-alive connection, send non-streaming one-message
      chats (max_tokens 8, ignore_eos) back to back for T seconds -> completed requests / s
  streams:     S clients stream chats (max_tokens 64, ignore_eos, include_usage) back to back
      for T seconds -> completion tokens received / s (from each stream's usage chunk)

The load generator is this one asyncio process speaking raw HTTP/1.1 (a client library would
cost more CPU than the server it measures). Connections spread over the API processes by the
kernel's SO_REUSEPORT hash; the answers' X-Splitserve-Api-Server header counts where they went.
The CPU seconds of every process (server, engine, API processes, this load generator) during
each phase are recorded: on a box with fewer cores than processes they share the cores, and
these say who used them.

    .venv/bin/python bench/frontend_scaleout.py [--seconds 20] [--clients 64] [--streams 32]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from serve_support import ServerProcess  # noqa: E402
from tiny_models import write_tiny_checkpoint  # noqa: E402

USAGE = re.compile(rb'"completion_tokens":(\d+)')
SERVED_BY = b"x-splitserve-api-server"


class Connection:
    """One keep-alive HTTP/1.1 connection; answers read by Content-Length or chunked encoding."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str) -> None:
        self.reader, self.writer, self.host = reader, writer, host

    @classmethod
    async def open(cls, host: str, port: int) -> Connection:
        reader, writer = await asyncio.open_connection(host, port)
        return cls(reader, writer, host)

    async def post(self, path: str, body: bytes) -> tuple[int, dict[bytes, bytes], bytes]:
        self.writer.write(b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n%s" % (path.encode(), self.host.encode(), len(body), body))
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        status = int(lines[0].split()[1])
        headers = dict(line.split(b": ", 1) for line in lines[1:] if b": " in line)
        headers = {k.lower(): v for k, v in headers.items()}
        if b"content-length" in headers:
            return status, headers, await self.reader.readexactly(int(headers[b"content-length"]))
        chunks = []
        while True:
            size = int((await self.reader.readline()).strip(), 16)
            if size == 0:
                await self.reader.readline()
                return status, headers, b"".join(chunks)
            chunks.append((await self.reader.readexactly(size + 2))[:-2])

    def close(self) -> None:
        self.writer.close()


def chat_body(i: int, max_tokens: int, stream: bool) -> bytes:
    body = {"messages": [{"role": "user", "content": f"Question {i}: what is the weather like today?"}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return json.dumps(body).encode()


async def drive(port: int, num_clients: int, seconds: float, stream: bool) -> dict:
    """num_clients connections send back to back for `seconds`; -> rates and where answers went."""
    served_by, failures = Counter(), Counter()
    num_done = num_tokens = 0
    deadline = time.perf_counter() + seconds

    async def client(c: int) -> None:
        nonlocal num_done, num_tokens
        conn = await Connection.open("127.0.0.1", port)
        i = 0
        try:
            while time.perf_counter() < deadline:
                status, headers, body = await conn.post("/v1/chat/completions",
                                                        chat_body(c * 100_000 + i, 64 if stream else 8, stream))
                i += 1
                if status != 200:
                    failures[status] += 1
                    continue
                served_by[headers.get(SERVED_BY, b"0").decode()] += 1
                num_done += 1
                usage = USAGE.findall(body)
                num_tokens += int(usage[-1]) if usage else 0
        finally:
            conn.close()

    start = time.perf_counter()
    await asyncio.gather(*(client(c) for c in range(num_clients)))
    wall = time.perf_counter() - start
    return {"requests": num_done, "seconds": round(wall, 2), "requests_per_s": round(num_done / wall, 1),
            "completion_tokens_per_s": round(num_tokens / wall, 1), "served_by": dict(served_by),
            "failures": dict(failures)}


def process_cpu(server: ServerProcess) -> dict[str, float]:
    """CPU seconds (user + system) so far of each server process and of this load generator."""
    root = psutil.Process(server.proc.pid)
    out = {"load_generator": sum(psutil.Process().cpu_times()[:2]), "coordinator": sum(root.cpu_times()[:2])}
    for child in root.children(recursive=True):
        cmd = " ".join(child.cmdline())
        name = "engine" if " engine " in cmd else "api_process" if "api_worker" in cmd else f"pid_{child.pid}"
        out[name] = out.get(name, 0.0) + sum(child.cpu_times()[:2])
    return out


def phase(server: ServerProcess, port: int, clients: int, seconds: float, stream: bool) -> dict:
    before = process_cpu(server)
    result = asyncio.run(drive(port, clients, seconds, stream))
    after = process_cpu(server)
    result["cpu_seconds"] = {k: round(after[k] - before.get(k, 0.0), 2) for k in after}
    return result


def run_setting(model: Path, count: int, args: argparse.Namespace, logs: Path) -> dict:
    server = ServerProcess(str(model), "--max-num-seqs", str(max(args.clients, args.streams)),
                           "--max-queued-requests", "256", "--kv-cache-memory", "64MiB",
                           "--api-server-count", str(count), log_path=logs / f"server_{count}.log")
    try:
        server.wait_ready()
        asyncio.run(drive(server.port, args.clients, args.warmup, stream=False))
        chats = phase(server, server.port, args.clients, args.seconds, stream=False)
        streams = phase(server, server.port, args.streams, args.seconds, stream=True)
    finally:
        server.stop()
    return {"api_server_count": count, "short_chats": chats, "streams": streams}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=20.0, help="per phase")
    p.add_argument("--warmup", type=float, default=3.0)
    p.add_argument("--clients", type=int, default=64, help="concurrent short-chat clients")
    p.add_argument("--streams", type=int, default=32, help="concurrent streaming clients")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "frontend_scaleout.json")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_checkpoint(Path(tmp) / "tiny", arch="llama")
        settings = [run_setting(model, count, args, Path(tmp)) for count in (1, 2)]
    one, two = settings
    report = {
        "cpu": platform.processor() or platform.machine(), "cores": len(os.sched_getaffinity(0)),
        "load_average_1m_at_end": os.getloadavg()[0], "seconds_per_phase": args.seconds,
        "clients": args.clients, "streams": args.streams, "settings": settings,
        "ratio_2_vs_1": {
            "short_chat_requests_per_s": round(two["short_chats"]["requests_per_s"]
                                               / one["short_chats"]["requests_per_s"], 2),
            "streamed_tokens_per_s": round(two["streams"]["completion_tokens_per_s"]
                                           / one["streams"]["completion_tokens_per_s"], 2)},
    }
    print(json.dumps(report, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
