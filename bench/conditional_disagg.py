"""Chats' TTFT while a document is prefilled, on 1 prefill + 1 decode, with each disaggregation policy.

    .venv/bin/python bench/conditional_disagg.py [--policies always threshold auto] [--doc-tokens 1500]
        [--chats 6] [--chat-tokens 64] [--answer-tokens 32]

For each policy: `serve --prefill 1 --decode 1 --threads-per-instance 1 --kv-transport shm
--disagg-policy P` on the bundled model; one document is sent, then `--chats` short prompts one
every 0.5 s while it is prefilled; each is streamed to its end. Prints, per policy, the chats' TTFT
(p50 and max), their longest inter-token gap, the document's TTFT, and where each prompt was
prefilled (the answer's `splitserve.prefill`). A smoke measurement, not a trial: one run, one
workload; the trial (examples/*.yaml, arrangement 1P1D-auto) is where capacities are compared.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import statistics
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def stream(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    sent, times, report = time.monotonic(), [], None
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                report = chunk.get("splitserve", report)
                if chunk.get("choices"):
                    times.append(time.monotonic())
    gaps = [b - a for a, b in zip(times, times[1:])]
    return {"ttft": times[0] - sent, "max_gap": max(gaps, default=0.0),
            "where": (report or {}).get("prefill", {}).get("where", "remote")}


async def workload(url: str, args) -> tuple[dict, list[dict]]:
    rng = random.Random(0)
    doc = [rng.randrange(100, 40000) for _ in range(args.doc_tokens)]
    async with httpx.AsyncClient(timeout=600) as client:
        doc_task = asyncio.create_task(stream(client, url, doc, args.answer_tokens))
        chats = []
        for _ in range(args.chats):
            await asyncio.sleep(0.5)
            chat = [rng.randrange(100, 40000) for _ in range(args.chat_tokens)]
            chats.append(asyncio.create_task(stream(client, url, chat, args.answer_tokens)))
        return await doc_task, list(await asyncio.gather(*chats))


def run_policy(policy: str, args) -> None:
    port = free_port()
    cmd = [sys.executable, "-m", "splitserve.cli", "serve", "--port", str(port), "--prefill", "1", "--decode", "1",
           "--threads-per-instance", "1", "--kv-transport", "shm", "--disagg-policy", policy, "--log-level", "warning"]
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"serve --disagg-policy {policy} did not start")
            time.sleep(0.5)
        asyncio.run(workload(url, argparse.Namespace(**{**vars(args), "chats": 1, "doc_tokens": 32})))  # warm up
        doc, chats = asyncio.run(workload(url, args))
        ttfts = [c["ttft"] for c in chats]
        print(f"{policy:>9}: chats TTFT p50 {statistics.median(ttfts):.2f} s, max {max(ttfts):.2f} s; "
              f"chats' longest gap {max(c['max_gap'] for c in chats):.2f} s; document TTFT {doc['ttft']:.2f} s; "
              f"chats prefilled locally {sum(c['where'] == 'local' for c in chats)}/{len(chats)}, "
              f"document {doc['where']}", flush=True)
    finally:
        proc.terminate()
        proc.wait(60)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--policies", nargs="+", default=["always", "threshold", "auto"])
    p.add_argument("--doc-tokens", type=int, default=1500)
    p.add_argument("--chats", type=int, default=6)
    p.add_argument("--chat-tokens", type=int, default=64)
    p.add_argument("--answer-tokens", type=int, default=32)
    args = p.parse_args()
    for policy in args.policies:
        run_policy(policy, args)


if __name__ == "__main__":
    main()
