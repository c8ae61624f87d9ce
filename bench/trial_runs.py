"""Run one trial spec several times in a row, optionally with the host disturbed on purpose, and
keep each run's verdict, capacity intervals and wall time side by side.

Issue 25's must-show: `make demo` three times in a row must give the same verdict with overlapping
ratio intervals, and one run with a busy loop started outside the trial (normal priority, for
60-120 s in the middle) must have the disturbed probes detected and redone. The busy loop is a
child of this script, not of the trial, so the trial's host watch counts it as another process.

    python bench/trial_runs.py examples/doc_heavy_bursty.yaml --runs 3 --out bench/results/quote
    python bench/trial_runs.py examples/doc_heavy_bursty.yaml --runs 1 --disturb-after-probes 3 \
        --disturb-for 90 --out bench/results/quote_disturbed

`--disturb-after-probes N` starts the loop when the trial has finished its N-th probe (read from
its output), so the disturbance lands among the probes and not in the servers' launch, which takes
a varying time; `--disturb-at S` starts it S seconds after the run's start.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))


def cpu_name() -> str:
    flags, model = set(), "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model == "unknown":
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    widest = "avx512f" if "avx512f" in flags else "avx2" if "avx2" in flags else "sse"
    return f"{model} ({platform.machine()}, {os.cpu_count()} CPUs, widest vector set {widest})"


def busy_loop(start_after: float, seconds: float, log: list) -> threading.Thread:
    """A pure-Python busy loop in its own process, started `start_after` s from now for `seconds`."""
    def run():
        time.sleep(start_after)
        p = subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
        log.append({"event": "busy_start", "t": time.time(), "pid": p.pid})
        time.sleep(seconds)
        p.send_signal(signal.SIGKILL)
        p.wait()
        log.append({"event": "busy_stop", "t": time.time(), "pid": p.pid})
    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th


def summarize(results: Path) -> dict:
    doc = json.loads(results.read_text())
    q = doc.get("quote") or {}
    out = {"verdict": doc.get("verdict"), "decision": q.get("decision"), "ratio": q.get("ratio"),
           "separated": q.get("separated"), "colocated": q.get("colocated"), "host": q.get("host"),
           "arrangements": {}}
    for name, c in (q.get("arrangements") or {}).items():
        out["arrangements"][name] = {k: c.get(k) for k in ("kind", "estimate_rps", "lo_rps", "hi_rps")}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("spec")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", required=True)
    ap.add_argument("--disturb-at", type=float, default=None, help="seconds after each run's start")
    ap.add_argument("--disturb-after-probes", type=int, default=None,
                    help="start the busy loop once the trial has finished this many probes")
    ap.add_argument("--disturb-for", type=float, default=90.0)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    exe = Path(sys.executable).parent / "splitserve"
    rows = []
    for k in range(args.runs):
        run_dir = out / f"run{k + 1}"
        log: list = []
        t0 = time.time()
        if args.disturb_at is not None:
            busy_loop(args.disturb_at, args.disturb_for, log)
        with open(out / f"run{k + 1}.log", "w") as f:
            proc = subprocess.Popen([str(exe), "trial", args.spec, "--out", str(run_dir)], stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, cwd=ROOT, text=True, bufsize=1)
            probes = 0
            for line in proc.stdout:
                f.write(line)
                f.flush()
                if args.disturb_after_probes is not None and " probe x" in line:
                    probes += 1
                    if probes == args.disturb_after_probes:
                        log.append({"event": "probes_done", "t": time.time(), "probes": probes})
                        busy_loop(0.0, args.disturb_for, log)
            rc = proc.wait()
        wall = time.time() - t0
        row = {"run": k + 1, "rc": rc, "wall_s": round(wall, 1), "started": time.strftime(
            "%H:%M:%S", time.gmtime(t0)), "disturbance": [{**e, "t": round(e["t"] - t0, 1)} for e in log]}
        if (run_dir / "results.json").exists():
            row.update(summarize(run_dir / "results.json"))
        rows.append(row)
        print(json.dumps({k2: row.get(k2) for k2 in ("run", "rc", "wall_s", "verdict")}, indent=1), flush=True)
    doc = {"spec": args.spec, "cpu": cpu_name(), "runs": rows}
    (out / "summary.json").write_text(json.dumps(doc, indent=1))
    print(f"summary: {out / 'summary.json'}")


if __name__ == "__main__":
    main()
