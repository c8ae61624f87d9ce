"""One trial: plan the workload once, then replay it against each arrangement in turn.

The plan (arrival times, classes, prompt token ids, answer lengths) is fixed by the seed
before the first request is sent, and every arrangement gets the very same plan after the
same warm-up. A sweep replays the plan compressed in time (rate x 0.5, x1, x2, ...) until
attainment drops below the target, so the highest passing rate is the arrangement's goodput
capacity (DistServe's definition).
"""
from __future__ import annotations

import asyncio
import dataclasses
import pathlib
from dataclasses import dataclass, field
from typing import Callable

from splitserve.trial.arrangements import Endpoint, LaunchError, launched
from splitserve.trial.arrivals import Arrival, generate_arrivals
from splitserve.trial.client import counter_deltas, http_tokenizer, run_load, scrape_counters
from splitserve.trial.faults import fault_outcomes, inject_fault
from splitserve.trial.metrics import RequestRecord, summarize
from splitserve.trial.spec import Arrangement, TrialSpec
from splitserve.trial.workload import (PlannedRequest, PromptSource, content_stream, plan_requests, recut,
                                      workload_streams)

Progress = Callable[[str, int], Callable[[RequestRecord], None]]  # (label, total) -> per-request callback


@dataclass(slots=True)
class RunResult:
    rate_multiplier: float
    summary: dict
    records: list[RequestRecord]
    server_counters: dict


@dataclass(slots=True)
class ArrangementResult:
    name: str
    runs: list[RunResult] = field(default_factory=list)
    error: str | None = None

    @property
    def main_run(self) -> RunResult | None:
        """The run at the spec's own rate (x1), or the first run of a sweep without one."""
        for run in self.runs:
            if run.rate_multiplier == 1.0:
                return run
        return self.runs[0] if self.runs else None


def local_tokenizer(model: str | None):
    from splitserve.models.loader import load_tokenizer  # imported late: it pulls in transformers

    tokenizer, _ = load_tokenizer(model)
    return lambda text: list(tokenizer.encode(text, add_special_tokens=False))


class Trial:
    def __init__(self, spec: TrialSpec, out_dir: pathlib.Path, progress: Progress | None = None):
        self.spec = spec
        self.out_dir = pathlib.Path(out_dir)
        self.progress = progress
        arrival_rng, self.content_rng = workload_streams(spec.seed)
        self.arrivals: list[Arrival] = generate_arrivals(spec.arrivals, arrival_rng)
        if not self.arrivals:
            raise ValueError("the arrivals section produced no requests; lengthen duration_s or raise rate")
        self.plan: list[PlannedRequest] | None = None
        self.source: PromptSource | None = None
        self._recuts: dict[int, list[PlannedRequest]] = {}

    def _ensure_plan(self, endpoint: Endpoint) -> list[PlannedRequest]:
        if self.plan is None:
            tokenize = (http_tokenizer(endpoint.base_url) if self.spec.tokenizer == "server"
                        else local_tokenizer(self.spec.model))
            self.source = PromptSource(tokenize)
            self.plan = plan_requests(self.spec, self.arrivals, self.source, self.content_rng)
        return self.plan

    def plan_for_run(self, run: int) -> list[PlannedRequest]:
        """Replay `run` of each arrangement: run 0 is the plan itself; later runs of a sweep (and
        the warm-up, run -1) get the same requests with fresh prompt text, so no replay finds
        the previous one's prompts in the server's prefix cache. Every arrangement gets the same."""
        if run == 0:
            return self.plan
        if run not in self._recuts:
            self._recuts[run] = recut(self.plan, self.spec, self.source, content_stream(self.spec.seed, run))
        return self._recuts[run]

    def run(self, sweep: bool = False) -> list[ArrangementResult]:
        multipliers = [1.0]
        if sweep:
            multipliers = self.spec.sweep.rate_multipliers if self.spec.sweep else [0.5, 1.0, 1.5, 2.0, 3.0]
        results = []
        for arr in self.spec.arrangements:
            results.append(self._run_arrangement(arr, multipliers, sweep))
        return results

    def _run_arrangement(self, arr: Arrangement, multipliers: list[float], sweep: bool) -> ArrangementResult:
        result = ArrangementResult(arr.name)
        target = self.spec.sweep.target_attainment if self.spec.sweep else 0.9
        try:
            with launched(arr, self.spec.model, self.out_dir / "logs") as endpoint:
                self._ensure_plan(endpoint)
                self._warm_up(endpoint, self.plan_for_run(-1))
                for i, multiplier in enumerate(multipliers):
                    run = self._replay(endpoint, self.plan_for_run(i), multiplier, f"{arr.name} x{multiplier:g}")
                    result.runs.append(run)
                    if sweep and run.summary["attainment"] < target:
                        break  # higher rates only do worse; the last passing rate is the answer
        except LaunchError as exc:
            result.error = str(exc)
        return result

    def _warm_up(self, endpoint: Endpoint, plan: list[PlannedRequest]) -> None:
        """Same warm-up for every arrangement: the first few planned requests, one at a time
        (with their own prompt text, so the measured run does not start on cached prompts)."""
        for req in plan[: self.spec.warmup_requests]:
            warm = dataclasses.replace(req, send_at_s=0.0, max_tokens=min(req.max_tokens, 8))
            asyncio.run(run_load(endpoint.base_url, [warm], self.spec.request_timeout_s, endpoint.model))

    def _replay(self, endpoint: Endpoint, plan: list[PlannedRequest], multiplier: float, label: str) -> RunResult:
        timed = [dataclasses.replace(r, send_at_s=r.send_at_s / multiplier) for r in plan]
        on_done = self.progress(label, len(timed)) if self.progress else None
        before = scrape_counters(endpoint.base_url)
        fault_events: list[dict] = []

        def scheduled(fault):
            async def run(t0: float) -> None:
                fault_events.append(await inject_fault(endpoint.base_url, fault, t0, multiplier))
            return run

        records = asyncio.run(run_load(endpoint.base_url, timed, self.spec.request_timeout_s,
                                       endpoint.model, on_done, [scheduled(f) for f in self.spec.faults]))
        counters = counter_deltas(before, scrape_counters(endpoint.base_url))
        summary = summarize(records, self.spec.slo, self.spec.pause_threshold_s)
        if self.spec.faults:
            fault_events.sort(key=lambda e: e["at_s"])
            summary["faults"] = fault_outcomes(fault_events, records, self.spec.slo, self.spec.pause_threshold_s)
        summary["rate_multiplier"] = multiplier
        summary["offered_rate_rps"] = (len(timed) - 1) / timed[-1].send_at_s if timed[-1].send_at_s > 0 else None
        return RunResult(multiplier, summary, records, counters)


def sweep_capacity(result: ArrangementResult, target: float) -> float | None:
    """The highest offered rate (requests/s) whose attainment met the target, if any did."""
    passing = [r.summary["offered_rate_rps"] for r in result.runs
               if r.summary["attainment"] >= target and r.summary["offered_rate_rps"] is not None]
    return max(passing) if passing else None

