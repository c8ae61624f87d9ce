"""The load generator: send each planned request on schedule, stream the answer, time every token.

One asyncio task per request sleeps until its scheduled second, then POSTs a streaming
`/v1/completions` with the prompt as token ids, `max_tokens`, `ignore_eos` and
`return_token_ids` (as vLLM names it). Each SSE chunk with a choice is stamped on arrival; a
server that names the chunk's `token_ids` gives per-token timing (a token whose text is held
back still arrives in its own chunk); one that cannot is timed per chunk, one token per text
chunk, and the record says so (`token_timing`). The usage block's completion_tokens is the
final count. An unexpected error in one request becomes that request's failure, never the
end of the replay.
The final chunk may carry a `splitserve` object with the server's per-request KV-transfer
report (see docs/internals.md, "Trial <-> server"). Nothing here decides what is good: it
only records what happened (metrics.py judges).
"""
from __future__ import annotations

import asyncio
import json
import re
import sys
import time
from typing import Awaitable, Callable, Sequence

import httpx

from splitserve.trial.metrics import RequestRecord
from splitserve.trial.workload import PlannedRequest

START_LEAD_S = 0.2  # let every task reach its sleep before the first request is due


def completion_body(req: PlannedRequest, model: str | None) -> dict:
    body = {"prompt": req.prompt_token_ids, "max_tokens": req.max_tokens, "ignore_eos": True,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
            "return_token_ids": True}
    if req.priority is not None:
        body["priority"] = req.priority
    if req.class_name:
        body["slo_class"] = req.class_name  # an adaptive server judges each class by its own targets
    if model:
        body["model"] = model
    return body


def _tokens_in_chunk(choice: dict) -> int:
    """Tokens this chunk delivers: `token_ids` or `num_tokens` when the server says, else one per text."""
    if isinstance(choice.get("token_ids"), list):
        return len(choice["token_ids"])
    if isinstance(choice.get("num_tokens"), int):
        return choice["num_tokens"]
    return 1 if choice.get("text") else 0


async def stream_one(client: httpx.AsyncClient, base_url: str, model: str | None, req: PlannedRequest,
                     t0: float, timeout_s: float, clock: Callable[[], float] = time.perf_counter,
                     live: dict[int, RequestRecord] | None = None) -> RequestRecord:
    """`live` (if given) sees the record while it streams: a watchdog may judge it before it ends."""
    rec = RequestRecord(req.index, req.class_name, req.num_prompt_tokens, req.max_tokens, req.send_at_s)
    if live is not None:
        live[req.index] = rec
    await asyncio.sleep(max(0.0, t0 + req.send_at_s - clock()))
    rec.sent_s = clock() - t0
    try:
        await _patiently(_stream_into(client, base_url, model, req, t0, rec, clock), rec, req, timeout_s)
    except Abandoned as exc:
        rec.error_kind, rec.error_message = "abandoned", str(exc)
    except asyncio.TimeoutError:
        rec.error_kind, rec.error_message = "timeout", f"no complete answer within {timeout_s}s"
    except httpx.TimeoutException as exc:
        rec.error_kind, rec.error_message = "timeout", f"{type(exc).__name__}: {exc}"
    except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
        rec.error_kind, rec.error_message = "connection_error", f"{type(exc).__name__}: {exc}"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        # the stream broke after it started: the client saw an interrupted answer
        rec.error_kind, rec.error_message = "cancelled", f"{type(exc).__name__}: {exc}"
    except asyncio.CancelledError:
        # a capacity probe that has already failed stops its remaining requests
        rec.error_kind, rec.error_message = "probe_stopped", "the probe stopped once it could no longer pass"
    except Exception as exc:  # an odd response (a chunk of the wrong shape) fails this request only
        rec.error_kind, rec.error_message = "cancelled", f"unreadable response: {type(exc).__name__}: {exc}"
    rec.finished_s = clock() - t0
    return rec


class Abandoned(Exception):
    """The client gave up (its class's patience) and disconnected."""


async def _patiently(stream, rec: RequestRecord, req: PlannedRequest, timeout_s: float) -> None:
    """Await the stream within timeout_s; with a patience, give up (cancel the stream, which closes
    the connection: the server sees a disconnect) when no first token or no whole answer came in time."""
    patience = req.patience
    if patience is None:
        await asyncio.wait_for(stream, timeout_s)
        return
    task = asyncio.ensure_future(stream)
    try:
        waited = 0.0
        if patience.ttft_s is not None and patience.ttft_s < timeout_s:
            await asyncio.wait({task}, timeout=patience.ttft_s)
            waited = patience.ttft_s
            if not task.done() and not rec.token_times_s:
                raise Abandoned(f"no first token within the class's patience ({patience.ttft_s} s)")
        total = min(timeout_s, patience.total_s) if patience.total_s is not None else timeout_s
        if not task.done():
            await asyncio.wait({task}, timeout=max(0.0, total - waited))
        if not task.done():
            if patience.total_s is not None and patience.total_s <= timeout_s:
                raise Abandoned(f"no complete answer within the class's patience ({patience.total_s} s)")
            raise asyncio.TimeoutError
        task.result()
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def _stream_into(client, base_url, model, req, t0, rec: RequestRecord, clock) -> None:
    body = completion_body(req, model)
    async with client.stream("POST", f"{base_url}/v1/completions", json=body) as resp:
        rec.http_status = resp.status_code
        if resp.status_code != 200:
            text = (await resp.aread()).decode(errors="replace")
            rec.error_kind, rec.error_message = "http_error", f"HTTP {resp.status_code}: {text[:300]}"
            try:
                _read_report(json.loads(text).get("splitserve"), rec)
            except (json.JSONDecodeError, AttributeError):
                pass  # an error page that is not JSON carries no report
            return
        saw_done = False
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                saw_done = True
                break
            chunk = json.loads(payload)
            now = clock() - t0
            _read_report(chunk.get("splitserve"), rec)  # before an error: a failed transfer reports too
            if "error" in chunk:
                rec.error_kind, rec.error_message = "cancelled", str(chunk["error"])[:300]
                return
            for choice in chunk.get("choices") or []:
                if isinstance(choice.get("token_ids"), list):
                    rec.token_timing = "token"
                rec.token_times_s.extend([now] * _tokens_in_chunk(choice))
                if choice.get("finish_reason"):
                    rec.finish_reason = choice["finish_reason"]
            usage = chunk.get("usage")
            if usage and usage.get("completion_tokens") is not None:
                rec.num_tokens = int(usage["completion_tokens"])
        if rec.num_tokens == 0:
            rec.num_tokens = len(rec.token_times_s)
        if not saw_done or rec.finish_reason in ("abort", "error"):
            rec.error_kind = "cancelled"
            rec.error_message = f"stream ended early (finish_reason={rec.finish_reason!r}, [DONE] seen: {saw_done})"


def _read_report(report: object, rec: RequestRecord) -> None:
    if not isinstance(report, dict):
        return
    if isinstance(report.get("kv_transfer"), dict):
        rec.kv_transfer = report["kv_transfer"]
        rec.retries += int(report["kv_transfer"].get("retries", 0) or 0)
    rec.retries += int(report.get("retries", 0) or 0)
    where = report["prefill"].get("where") if isinstance(report.get("prefill"), dict) else None
    if where in ("local", "remote"):
        rec.prefill = where


async def run_load(base_url: str, requests: list[PlannedRequest], timeout_s: float,
                   model: str | None = None, on_done: Callable[[RequestRecord], None] | None = None,
                   side_tasks: Sequence[Callable[[float], Awaitable[object]]] = (),
                   stop: asyncio.Event | None = None,
                   live: dict[int, RequestRecord] | None = None) -> list[RequestRecord]:
    """Send every request at its scheduled second; return records in request order.
    side_tasks (e.g. scheduled faults) are started with the same zero time t0 and awaited too;
    one that raises is reported on stderr and loses no request's record. Setting `stop` (from
    on_done) cancels every request still due or streaming: they are recorded as probe_stopped."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    timeout = httpx.Timeout(timeout_s, connect=10.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        t0 = time.perf_counter() + START_LEAD_S
        records = [RequestRecord(r.index, r.class_name, r.num_prompt_tokens, r.max_tokens, r.send_at_s)
                   for r in requests]

        async def one(n, req):
            try:
                records[n] = await stream_one(client, base_url, model, req, t0, timeout_s, live=live)
            except asyncio.CancelledError:
                records[n].error_kind = "probe_stopped"
                records[n].error_message = "the probe stopped once it could no longer pass"
                records[n].finished_s = time.perf_counter() - t0
                return
            if on_done is not None:
                on_done(records[n])

        tasks = [asyncio.ensure_future(one(n, r)) for n, r in enumerate(requests)]
        sides = [asyncio.ensure_future(task(t0)) for task in side_tasks]
        watcher = asyncio.ensure_future(stop.wait()) if stop is not None else None
        pending = set(tasks)
        while pending:
            wait_on = pending | ({watcher} if watcher is not None else set())
            await asyncio.wait(wait_on, return_when=asyncio.FIRST_COMPLETED)
            pending = {t for t in pending if not t.done()}
            if watcher is not None and watcher.done():
                for t in pending:
                    t.cancel()
                for t in sides:
                    t.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
                break
        if watcher is not None:
            watcher.cancel()
        for outcome in await asyncio.gather(*sides, return_exceptions=True):
            if isinstance(outcome, BaseException) and not isinstance(outcome, asyncio.CancelledError):
                print(f"splitserve trial: a scheduled side task failed: {outcome!r}", file=sys.stderr)
        return records


def http_tokenizer(base_url: str) -> Callable[[str], list[int]]:
    """Tokenize with the server's own tokenizer (POST /tokenize), so token-id prompts match its model."""

    def tokenize(text: str) -> list[int]:
        resp = httpx.post(f"{base_url}/tokenize", json={"prompt": text, "add_special_tokens": False},
                          timeout=60.0)
        if resp.status_code != 200:
            raise RuntimeError(f"{base_url}/tokenize answered HTTP {resp.status_code}: {resp.text[:200]}; "
                               "set tokenizer: local in the spec to tokenize in-process")
        return [int(t) for t in resp.json()["tokens"]]

    return tokenize


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)")


def scrape_counters(base_url: str, prefixes=("splitserve_kv", "kv_transfer", "splitserve_request",
                                             "preemptions", "splitserve_aborted_tokens")) -> dict:
    """Prometheus samples whose names mention KV transfers or requests; {} if /metrics is absent."""
    try:
        resp = httpx.get(f"{base_url}/metrics", timeout=5.0)
    except httpx.HTTPError:
        return {}
    if resp.status_code != 200:
        return {}
    out = {}
    for line in resp.text.splitlines():
        m = _SAMPLE.match(line)
        # histogram buckets repeat what _sum and _count say, one line per bound: skip them
        if m and any(p in m.group(1) for p in prefixes) and not m.group(1).endswith("_bucket"):
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def counter_deltas(before: dict, after: dict) -> dict:
    # a counter below its earlier value was reset (a coordinator restart starts them from 0): it counts since
    return {k: v - before.get(k, 0.0) if v >= before.get(k, 0.0) else v
            for k, v in after.items() if v != before.get(k, 0.0)}
