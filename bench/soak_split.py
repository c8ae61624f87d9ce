"""Soak of split serving under faults (issue 15's must-show): mixed traffic with random client
aborts and random X-Request-Id reuse, while a prefill and a decode engine are each SIGKILLed once
and restarted once through `POST /admin/instances`; afterwards nothing may have leaked.

    .venv/bin/python bench/soak_split.py [--seconds 600] [--rate 6] [--json out.json]

Starts `splitserve serve --prefill 2 --decode 2` on loopback (tiny random-weight model), so each
stage keeps a survivor when one of its engines dies. After a warm-up it takes a baseline, runs
the load for `seconds` with the prefill kill at 25% and the decode kill at 55% of it (each
restarted `--restart-after` seconds later), waits for the engines to settle and compares:
the frontend's fds and threads, the engines' fds and threads (the restarted ones replace the
killed ones), KV blocks in use, blocks held for a handover (leases) and transfers in flight on the
live instances (read from /metrics), and the /dev/shm KV segments of every process the server ran
(including the killed ones: a dead prefill's segment must be gone too); `by_engine` lists each
engine's [fds, threads]. Exits 1 on any 5xx, leak
or fault that did not complete.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import re
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "bench"))

import httpx  # noqa: E402

from load import open_loop, random_completion, sample_tree, serve_and_report  # noqa: E402
from serve_disagg_support import DisaggServer  # noqa: E402
from serve_support import metric_samples, wait_until  # noqa: E402
from splitserve.kv_transfer.shm_pool import SEGMENT_PREFIX, SHM_DIR  # noqa: E402
from splitserve.trial.faults import inject_fault  # noqa: E402
from splitserve.trial.spec import FaultSpec  # noqa: E402

REUSED_IDS = [f"soak-reused-{n}" for n in range(8)]  # few enough that concurrent duplicates are common


def start_server(root: Path, arrangement: list[str]) -> DisaggServer:
    from tiny_models import write_tiny_checkpoint

    model = write_tiny_checkpoint(root / "tiny", arch="llama")
    return DisaggServer(str(model), *arrangement, "--max-num-seqs", "16", "--max-queued-requests", "32",
                        log_path=root / "server.log").wait_ready()


def mixed_requests(seed: int, abort_share: float, reuse_share: float):
    rng = random.Random(seed)

    def make(i: int):
        body = random_completion(rng, max_prompt_words=60, max_tokens=(2, 64))
        leave = rng.randint(1, 6) if rng.random() < abort_share else None
        headers = {"X-Request-Id": rng.choice(REUSED_IDS)} if rng.random() < reuse_share else None
        return body, leave, headers

    return make


def by_instance(base_url: str, name: str) -> dict[str, float]:
    return {re.search(r'instance="([^"]+)"', k).group(1): v for k, v in metric_samples(base_url, name).items()}


def kv_state(base_url: str) -> dict:
    """Sums over the live instances (a dead one's gauges keep their last value)."""
    alive = {i for i, v in by_instance(base_url, "splitserve_instance_alive").items() if v == 1}

    def total(name: str) -> float:
        return sum(v for i, v in by_instance(base_url, name).items() if i in alive)

    return {"alive_instances": len(alive), "blocks_used": total("splitserve_instance_kv_blocks_used"),
            "held_blocks": total("splitserve_kv_held_blocks"),
            "transfers_in_flight": total("splitserve_kv_transfers_in_flight"),
            "outstanding_tokens": total("splitserve_instance_outstanding_tokens")}


def settled(state: dict, instances: int) -> bool:
    return state["alive_instances"] == instances and not any(
        state[k] for k in ("blocks_used", "held_blocks", "transfers_in_flight", "outstanding_tokens"))


def segments(pids: set[int]) -> list[str]:
    """The KV segments in /dev/shm created by any of these processes (names carry the creator's pid)."""
    return sorted(p.name for p in Path(SHM_DIR).glob(f"{SEGMENT_PREFIX}*")
                  if any(p.name.startswith(f"{SEGMENT_PREFIX}{pid}-") for pid in pids))


def resources(base_url: str, root_pid: int) -> dict:
    sample = sample_tree(root_pid)
    engines = [pid for pid in sample.num_fds if pid != root_pid]
    roles = {i["pid"]: f"{i['id']} ({i['role']})" for i in httpx.get(base_url + "/admin/instances").json()["instances"]}
    return {"frontend_fds": sample.num_fds.get(root_pid), "frontend_threads": sample.num_threads.get(root_pid),
            "engine_fds": sum(sample.num_fds[p] for p in engines),
            "engine_threads": sum(sample.num_threads[p] for p in engines), "pids": set(sample.num_fds),
            "by_engine": {roles.get(p, str(p)): [sample.num_fds[p], sample.num_threads[p]] for p in engines}}


def lease_expiries(base_url: str) -> float:
    return sum(metric_samples(base_url, "splitserve_kv_lease_expiries").values())


async def soak(srv: DisaggServer, args) -> dict:
    base, instances = srv.base_url, args.prefill + args.decode
    await open_loop(base, args.rate, args.warmup_seconds, mixed_requests(1, args.abort_share, args.reuse_share))
    assert wait_until(lambda: settled(kv_state(base), instances), timeout_s=60), f"not settled: {kv_state(base)}"
    time.sleep(1.0)
    before = resources(base, srv.proc.pid)
    seen_pids = set(before["pids"])
    shm_before = segments(seen_pids)
    t0 = time.perf_counter()
    restart = args.restart_after
    faults = [FaultSpec(0.25 * args.seconds, "prefill", restart), FaultSpec(0.55 * args.seconds, "decode", restart)]
    load, *events = await asyncio.gather(
        open_loop(base, args.rate, args.seconds, mixed_requests(2, args.abort_share, args.reuse_share),
                  timeout_s=120.0),
        *(inject_fault(base, f, t0) for f in faults))
    seen_pids |= {e["pid"] for e in events if e["pid"]}
    ok = wait_until(lambda: settled(kv_state(base), instances), timeout_s=60)
    time.sleep(2.0)  # closed connections and finished requests settle
    after, kv_after = resources(base, srv.proc.pid), kv_state(base)
    seen_pids |= after["pids"]
    probe = httpx.post(base + "/v1/completions", json={"prompt": "hello", "max_tokens": 4}, timeout=60)
    report = {"seconds": round(load.seconds, 1), "rate": args.rate, "offered": load.offered,
              "outcomes": load.counts(), "faults": events, "settled_after": ok, "kv_after": kv_after,
              "lease_expiries": lease_expiries(base), "probe_status": probe.status_code,
              "before": {k: v for k, v in before.items() if k != "pids"},
              "after": {k: v for k, v in after.items() if k != "pids"},
              "shm_segments_before": len(shm_before), "shm_segments_after": len(segments(seen_pids))}
    report["growth"] = {k: v - report["before"][k] for k, v in report["after"].items() if k != "by_engine"}
    return report


def failures(report: dict) -> list[str]:
    why = [f"fault {e['kill']}: {e['error']}" for e in report["faults"] if e["error"] or e["rejoined_s"] is None]
    if report["outcomes"].get("server_error"):
        why.append(f"{report['outcomes']['server_error']} server errors (5xx)")
    if not report["settled_after"]:
        why.append(f"KV not back to idle: {report['kv_after']}")
    why += [f"{k} grew by {v}" for k, v in report["growth"].items() if v > 0]
    if report["shm_segments_after"] != report["shm_segments_before"]:
        why.append(f"/dev/shm segments {report['shm_segments_before']} -> {report['shm_segments_after']}")
    if report["probe_status"] != 200:
        why.append(f"a request after the soak got HTTP {report['probe_status']}")
    return why


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=600.0)
    p.add_argument("--rate", type=float, default=6.0, help="requests per second")
    p.add_argument("--abort-share", type=float, default=0.3)
    p.add_argument("--reuse-share", type=float, default=0.3, help="share of requests sending a reused X-Request-Id")
    p.add_argument("--warmup-seconds", type=float, default=10.0)
    p.add_argument("--restart-after", type=float, default=None,
                   help="seconds from a kill to its restart (default: 10%% of --seconds)")
    p.add_argument("--prefill", type=int, default=2)
    p.add_argument("--decode", type=int, default=2)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    if args.restart_after is None:
        args.restart_after = 0.1 * args.seconds
    arrangement = ["--prefill", str(args.prefill), "--decode", str(args.decode)]
    report = serve_and_report(lambda root: start_server(root, arrangement), lambda srv: soak(srv, args), None)
    report["failures"] = failures(report)
    print("failures:", report["failures"] or "none")
    if args.json:
        import json

        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
