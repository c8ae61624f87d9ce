"""What watching the host costs: the sampler's CPU per sample and as a share of one core.

    python bench/hostwatch_cost.py --seconds 10 --interval 0.5 --extra-procs 220

Starts `--extra-procs` sleeping processes (so the box has ~300 to read, as a busy trial host
would), runs one HostWatch window of `--seconds` with our own pid as "own", and prints the number
of processes read per sample, the sampler thread's CPU per sample, and that as a share of one
core at the given interval. Also prints speed_benchmark() twice, as units per second.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import time

from splitserve.trial.hostwatch import HostWatch, speed_benchmark


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--interval", type=float, default=0.5)
    parser.add_argument("--extra-procs", type=int, default=220)
    args = parser.parse_args()

    # Started by a shell that exits at once, so they are not our descendants ("own") but other
    # processes, as the host's daemons are; each ends by itself if we are killed first.
    launcher = subprocess.run(
        ["sh", "-c", f'for i in $(seq {args.extra_procs}); do sleep {args.seconds + 60:.0f} & echo $!; done'],
        check=True, capture_output=True, text=True)
    sleepers = [int(pid) for pid in launcher.stdout.split()]
    try:
        time.sleep(0.5)
        num_procs = sum(1 for name in os.listdir("/proc") if name.isdigit())
        watch = HostWatch([os.getpid()], sample_interval_s=args.interval)
        with watch:
            time.sleep(args.seconds)
        reading = watch.reading
        per_sample_ms = 1000 * watch.sample_cpu_s / max(watch.samples_taken, 1)
        print(json.dumps({
            "processes": num_procs,
            "samples": watch.samples_taken,
            "sampler_cpu_s": round(watch.sample_cpu_s, 4),
            "cpu_ms_per_sample": round(per_sample_ms, 3),
            "share_of_one_core": round(per_sample_ms / 1000 / args.interval, 5),
            "speed_units_per_s": [round(speed_benchmark(), 1), round(speed_benchmark(), 1)],
            "reading": reading.to_json(),
        }, indent=1))
    finally:
        for pid in sleepers:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass


if __name__ == "__main__":
    main()
