"""Prometheus metrics of one frontend: request outcomes, latencies, and each instance's state.

Each `FrontendMetrics` owns its registry (no process-global registry), so two servers in
one process (tests) never share counters.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from splitserve.protocol import EngineStats, KVTransferReport

OUTCOMES = ("stop", "length", "abort", "error", "rejected")
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
KV_OUTCOMES = ("ok", "recomputed", "failed")
GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class FrontendMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("splitserve_requests", "Finished requests by outcome", ["outcome"], registry=r)
        self.retries = Counter("splitserve_request_retries", "Requests sent again to another instance because "
                               "theirs died before their first token", registry=r)
        self.resumes = Counter("splitserve_request_resumes", "Streams resumed on another instance (prompt + "
                               "tokens so far recomputed) because theirs died mid-stream", registry=r)
        self.handed_back = Counter("splitserve_prompts_handed_back", "Unstarted prompts an engine dropped for a "
                                   "role change (a new decode instance's queue, or a prefill instance's prompts "
                                   "planned onto a decode instance leaving its role), placed again", registry=r)
        self.role_changes = Counter("splitserve_role_changes", "Live role changes of engine instances",
                                    ["from_role", "to_role"], registry=r)
        self.mix_decisions = Counter("splitserve_mix_decisions", "serve --adaptive: decisions by action "
                                     "(none | change | refused)", ["action"], registry=r)
        self.disagg_decisions = Counter("splitserve_disagg_decisions", "Disaggregated serving: where prompts "
                                        "were prefilled (local: on their decode instance) and why", ["prefill", "reason"],
                                        registry=r)
        self.cached_prompt_tokens = Counter("splitserve_cached_prompt_tokens", "Prompt tokens the prefix cache "
                                            "served on the instance that prefilled them", registry=r)
        # POST /admin/coordinator/restart: this serve's restarts in place and the requests they ended
        # (carried over the re-exec; every other counter starts again from 0 in the new process)
        self.coordinator_restarts = Counter("splitserve_coordinator_restarts", "Coordinator restarts in place "
                                            "(engines kept)", registry=r)
        self.coordinator_restart_failed = Counter("splitserve_coordinator_restart_failed_requests",
                                                  "Requests in flight ended with an error by coordinator "
                                                  "restarts", registry=r)
        self.prompt_tokens = Counter("splitserve_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("splitserve_generation_tokens", "Tokens generated", registry=r)
        # work spent on requests aborted before their end (clients that left, mostly): prompt tokens
        # of those that had their first token (prefilled), and the tokens generated for them
        self.aborted_tokens = Counter("splitserve_aborted_tokens", "Work done for aborted requests",
                                      ["kind"], registry=r)
        self.ttft = Histogram("splitserve_time_to_first_token_seconds", "Time to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.inter_token = Histogram("splitserve_inter_token_gap_seconds", "Gap between streamed tokens",
                                     buckets=GAP_BUCKETS, registry=r)
        self.e2e = Histogram("splitserve_e2e_latency_seconds", "Request end-to-end latency",
                             buckets=LATENCY_BUCKETS, registry=r)
        labels = ["instance", "role"]
        self.queued = Gauge("splitserve_instance_queued_requests", "Requests waiting in the engine",
                            labels, registry=r)
        self.running = Gauge("splitserve_instance_running_requests", "Requests running in the engine",
                             labels, registry=r)
        self.blocks_used = Gauge("splitserve_instance_kv_blocks_used", "KV blocks in use", labels, registry=r)
        self.blocks_free = Gauge("splitserve_instance_kv_blocks_free", "KV blocks free", labels, registry=r)
        self.hit_rate = Gauge("splitserve_instance_prefix_cache_hit_rate",
                              "Prefix-cache hits / queries (tokens), since start", labels, registry=r)
        self.preemptions = Gauge("splitserve_instance_preemptions", "Preemptions since start", labels, registry=r)
        self.alive = Gauge("splitserve_instance_alive", "1 while the instance is alive", labels, registry=r)
        self.outstanding = Gauge("splitserve_instance_outstanding_tokens",
                                 "Router's view: prompt + answer tokens still to do", labels, registry=r)
        self.role = Gauge("splitserve_instance_role", "1 for the instance's role (colocated|prefill|decode)",
                          labels, registry=r)
        # KV transfers (disaggregated), counted per request from the decode instances' reports
        self.kv_transfers = Counter("splitserve_kv_transfers", "KV transfers by outcome (ok|recomputed|failed)",
                                    ["outcome"], registry=r)
        self.kv_transfer_bytes = Counter("splitserve_kv_transfer_bytes", "KV bytes moved between instances",
                                         registry=r)
        self.kv_transfer_seconds = Histogram("splitserve_kv_transfer_seconds", "Time a transfer's bytes moved",
                                             buckets=TRANSFER_BUCKETS, registry=r)
        self.kv_transfer_failures = Counter("splitserve_kv_transfer_failures", "Failed KV transfers by kind",
                                            ["kind"], registry=r)
        self.kv_lease_expiries = Gauge("splitserve_kv_lease_expiries",
                                       "Handed-over KV never pulled within the lease (prefill), since start",
                                       labels, registry=r)
        self.kv_held_blocks = Gauge("splitserve_kv_held_blocks", "Blocks a prefill instance holds for a handover",
                                    labels, registry=r)
        self.kv_in_flight = Gauge("splitserve_kv_transfers_in_flight",
                                  "Transfers a decode instance is waiting for or moving", labels, registry=r)
        for outcome in OUTCOMES:
            self.requests.labels(outcome)  # present at 0 from the start
        for outcome in KV_OUTCOMES:
            self.kv_transfers.labels(outcome)

    def observe_transfer(self, report: KVTransferReport, outcome: str) -> None:
        self.kv_transfers.labels(outcome).inc()
        self.kv_transfer_bytes.inc(report.num_bytes)
        if report.outcome == "ok":
            self.kv_transfer_seconds.observe(report.seconds)
        else:
            self.kv_transfer_failures.labels(report.error_kind or "unknown").inc()

    def observe_stats(self, stats: EngineStats) -> None:
        labels = (stats.engine_id, stats.role)
        self.queued.labels(*labels).set(stats.num_waiting)
        self.running.labels(*labels).set(stats.num_running)
        self.blocks_used.labels(*labels).set(stats.num_blocks_total - stats.num_free_blocks)
        self.blocks_free.labels(*labels).set(stats.num_free_blocks)
        rate = stats.prefix_cache_hits / stats.prefix_cache_queries if stats.prefix_cache_queries else 0.0
        self.hit_rate.labels(*labels).set(rate)
        self.preemptions.labels(*labels).set(stats.num_preemptions)
        if stats.kv is not None:
            self.kv_lease_expiries.labels(*labels).set(stats.kv.num_lease_expiries)
            self.kv_held_blocks.labels(*labels).set(stats.kv.num_held_blocks)
            self.kv_in_flight.labels(*labels).set(stats.kv.num_pending + stats.kv.num_transferring)

    def set_alive(self, instance_id: str, role: str, alive: bool) -> None:
        self.alive.labels(instance_id, role).set(1 if alive else 0)
        self.role.labels(instance_id, role).set(1)

    def set_role(self, instance_id: str, old: str, new: str) -> None:
        """A live role change: the instance's series move to the new role label."""
        for gauge in (self.queued, self.running, self.blocks_used, self.blocks_free, self.hit_rate,
                      self.preemptions, self.outstanding, self.kv_lease_expiries, self.kv_held_blocks,
                      self.kv_in_flight, self.role, self.alive):
            try:
                gauge.remove(instance_id, old)
            except KeyError:
                pass
        self.set_alive(instance_id, new, True)

    def render(self) -> bytes:
        return generate_latest(self.registry)
