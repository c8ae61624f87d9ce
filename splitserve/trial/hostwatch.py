"""A watched host: how much of the machine others took while a probe ran, and how fast it was.

A capacity probe is only a measurement of the arrangement if the arrangement had the cores. On a
shared machine (a VM with noisy neighbours, a laptop, a box where someone starts a build) other
work takes cores from the probe and the probe's share of good requests falls for reasons that have
nothing to do with the arrangement. `HostWatch` measures that during a window:

- **others_cpu_s** = (the machine's non-idle time from /proc/stat over the window: user + nice +
  system + irq + softirq, which already contain guest time, and leave out idle, iowait and steal)
  minus (the CPU time of the "own" processes over the window), floored at 0. Taking the machine's
  total rather than summing per-process deltas catches a process that starts and exits between
  two samples, and interrupt time, which no process carries. It is never less than the sum of
  the non-own processes' own deltas (below): /proc/stat's busy time is sampled at the tick and a
  process's utime + stime is its exact run time, so on a box of many short bursts the machine's
  total can read a few ticks per process below what the processes themselves report (CI read
  1.72 s against 1.84 s named in one busy 1-second window); the larger of the two is the reading.
- "own" = the given root pids and all their descendants, re-read at every sample: a trial's
  servers and engines start and stop under it. An own process's CPU is utime + stime plus its
  reaped children's (cutime + cstime), so a short-lived child of an own process that ran and was
  reaped between samples stays own; an own child seen earlier and then reaped is not counted twice.
- **top_others** come from per-process deltas (utime + stime of each non-own process, keyed by pid
  and start time so a reused pid is a new process): the processes to name in a report. Those that
  lived only between samples are in others_cpu_s but cannot be named.
- **steal_share** = steal / (all of /proc/stat's time fields but the guest ones) over the window:
  on a VM, the time the hypervisor gave our virtual cores to someone else.

A window is **disturbed** when others_share + steal_share > threshold (default 0.10 of all cores).
Why 0.10: what hurts a probe is a steady competitor, and the smallest one that matters, a busy loop
on one core of a 2-core box, reads 0.5; the trial's own load generator and the arrangement's
frontend and engines are own, so they never count. Background daemons, shells and this sampler
itself read well under 0.05 on a quiet box; 0.10 leaves them room while a third of a core taken for
the whole probe (or a whole core for a fifth of it) is flagged.

Cost: a sample lists /proc and reads /proc/[pid]/stat of every busy, new or own process; one whose
counters did not move is re-read only every 4th sample (cumulative counters: nothing is lost).
bench/hostwatch_cost.py, 355 processes, 0.5 s interval, 2-core EPYC at load average 12: 1.5 ms of
CPU per sample, 0.3% of one core (reading all of them every sample: 6-7 ms, 1.3%).

Linux only: elsewhere (no /proc/stat) `stop()` returns a reading with available=False, zeros and
disturbed=False, so a trial runs on and says the host was not watched.
"""
from __future__ import annotations

import math
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable, NamedTuple

_PROC = "/proc"
_TOP_OTHERS = 5
_IDLE_EVERY = 4     # an idle process is re-read every 4th sample: most of ~300 are idle daemons


@dataclass(frozen=True)
class HostReading:
    wall_s: float
    cores: int
    others_cpu_s: float           # CPU seconds of processes outside `own` during the window
    others_share: float           # others_cpu_s / (wall_s * cores)
    steal_share: float            # steal jiffies / all jiffies in the window (/proc/stat)
    top_others: tuple[tuple[int, str, float], ...]  # (pid, command name, cpu_s), largest first, at most 5
    disturbed: bool               # others_share + steal_share > threshold
    available: bool = True        # False where /proc is missing: the figures above are zeros, not readings

    def to_json(self) -> dict:
        out = asdict(self)
        out["top_others"] = [list(entry) for entry in self.top_others]
        return out

    @classmethod
    def from_json(cls, data: dict) -> HostReading:
        values = dict(data)
        values["top_others"] = tuple((int(p), str(n), float(c)) for p, n, c in data.get("top_others", ()))
        return cls(**values)


class _Proc(NamedTuple):
    ppid: int
    comm: str
    self_ticks: int     # utime + stime
    child_ticks: int    # cutime + cstime: reaped children


_ProcKey = tuple[int, int]   # (pid, start time in ticks since boot): a reused pid is another process


class _CpuTicks(NamedTuple):
    busy: int    # user + nice + system + irq + softirq (guest is inside user/nice already)
    steal: int
    total: int   # every field but guest/guest_nice (they would be counted twice)


def _read_bytes(path: str) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.read(fd, 4096)
    finally:
        os.close(fd)


def _read_cpu_ticks() -> tuple[_CpuTicks, int]:
    """The aggregate `cpu` line of /proc/stat and the number of online cores (cpuN lines)."""
    with open(f"{_PROC}/stat", "rb") as f:
        text = f.read()
    lines = text.split(b"\n")
    values = [int(v) for v in lines[0].split()[1:]] + [0] * 10
    user, nice, system, idle, iowait, irq, softirq, steal = values[:8]
    cores = sum(1 for line in lines[1:] if line.startswith(b"cpu"))
    return _CpuTicks(user + nice + system + irq + softirq, steal,
                     user + nice + system + idle + iowait + irq + softirq + steal), max(cores, 1)


def _read_proc(pid: int) -> tuple[_ProcKey, _Proc] | None:
    """One /proc/[pid]/stat, or None when the process exited meanwhile (or is hidden from us)."""
    try:
        raw = _read_bytes(f"{_PROC}/{pid}/stat")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split at the last ')'.
    close = raw.rfind(b")")
    rest = raw[close + 2:].split(None, 20)
    if close < 0 or len(rest) < 20:
        return None
    comm = raw[raw.find(b"(") + 1:close].decode("utf-8", "replace")
    # rest[0] is field 3 (state): ppid is field 4, utime..cstime 14-17, starttime 22.
    return (pid, int(rest[19])), _Proc(int(rest[1]), comm, int(rest[11]) + int(rest[12]),
                                       int(rest[13]) + int(rest[14]))


def _list_pids() -> list[int]:
    return [int(name) for name in os.listdir(_PROC) if name.isdigit()]


def _own_keys(procs: dict[_ProcKey, _Proc], roots: Iterable[int]) -> set[_ProcKey]:
    children: dict[int, list[_ProcKey]] = {}
    by_pid: dict[int, _ProcKey] = {}
    for key, proc in procs.items():
        children.setdefault(proc.ppid, []).append(key)
        by_pid[key[0]] = key
    own: set[_ProcKey] = set()
    stack = [by_pid[pid] for pid in set(roots) if pid in by_pid]
    while stack:
        key = stack.pop()
        if key in own:
            continue
        own.add(key)
        stack.extend(children.get(key[0], ()))
    return own


def process_tree_cpu_s(root_pids: Iterable[int]) -> float:
    """CPU seconds (utime + stime, and their reaped children's) the given processes and all their
    live descendants have used since they started: the difference of two readings is what a
    process tree took over a window (splitserve profile's host-work pass reads a server's)."""
    procs = {}
    for pid in _list_pids():
        got = _read_proc(pid)
        if got is not None:
            procs[got[0]] = got[1]
    ticks = sum(procs[k].self_ticks + procs[k].child_ticks for k in _own_keys(procs, root_pids))
    return ticks / (os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100)


@dataclass
class _Tally:
    """Running sums over a window, advanced one sample at a time so memory stays bounded."""
    own_ticks: int = 0
    others_by_proc: dict[_ProcKey, list] = field(default_factory=dict)   # key -> [comm, ticks]


class HostWatch:
    def __init__(self, own_root_pids: Iterable[int] | Callable[[], Iterable[int]], *, threshold: float = 0.10,
                 sample_interval_s: float = 0.5, top_n: int = _TOP_OTHERS):
        if not 0 < threshold:
            raise ValueError(f"HostWatch threshold must be a positive share of the cores, got {threshold}")
        if not sample_interval_s > 0:
            raise ValueError(f"HostWatch sample_interval_s must be positive, got {sample_interval_s}")
        self._roots = own_root_pids if callable(own_root_pids) else tuple(own_root_pids)
        self.threshold = threshold
        self.sample_interval_s = sample_interval_s
        self.top_n = top_n            # how many others to name; a saturated box has many of equal size
        self._ticks_per_s = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.reading: HostReading | None = None
        self.samples_taken = 0
        self.sample_cpu_s = 0.0       # this process's CPU spent sampling: the watch's own cost
        self.own_cpu_s = 0.0          # after stop(): CPU seconds the own processes took in the window

    def _root_pids(self) -> list[int]:
        return list(self._roots() if callable(self._roots) else self._roots)

    # -- the window ---------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("HostWatch.start() called twice; make a new HostWatch per window")
        self._t0 = time.monotonic()
        self._tally = _Tally()
        self.reading = None
        try:
            self._cpu0, self._cores = _read_cpu_ticks()
        except OSError:
            self._available = False
            self._thread = threading.Thread()   # marks the watch as started
            return
        self._available = True
        self._prev, self._prev_own, self._active, self._key_of = {}, set(), set(), {}
        self._prev = self._scan(full=True)
        self._prev_own = _own_keys(self._prev, self._root_pids())
        self._thread = threading.Thread(target=self._run, name="hostwatch", daemon=True)
        self._thread.start()

    def stop(self) -> HostReading:
        if self._thread is None:
            raise RuntimeError("HostWatch.stop() before start()")
        if self.reading is not None:
            return self.reading
        wall_s = time.monotonic() - self._t0
        if not self._available:
            self.reading = HostReading(wall_s, os.cpu_count() or 1, 0.0, 0.0, 0.0, (), False, available=False)
            return self.reading
        self._stop.set()
        self._thread.join()
        self._sample(full=True)
        cpu1, _ = _read_cpu_ticks()
        self.reading = self._reading(wall_s, cpu1)
        return self.reading

    def __enter__(self) -> HostWatch:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- sampling: the sampler thread owns the state below until stop() has joined it ------------
    def _scan(self, full: bool) -> dict[_ProcKey, _Proc]:
        """Every live process's latest record. A process whose counters did not move at its last
        read is idle: it is re-read every _IDLE_EVERY-th sample (staggered by pid) and carried
        over in between. Its counters are cumulative, so a late read loses none of its time;
        busy, new and own processes are read every sample."""
        prev, active, own = self._prev, self._active, self._prev_own
        cur: dict[_ProcKey, _Proc] = {}
        for pid in _list_pids():
            key = self._key_of.get(pid)
            if (not full and key is not None and key not in active and key not in own
                    and (pid + self.samples_taken) % _IDLE_EVERY):
                cur[key] = prev[key]
                continue
            got = _read_proc(pid)
            if got is None:
                continue
            key, proc = got
            cur[key] = proc
            before = prev.get(key)
            if before is None or before[2:] != proc[2:]:
                active.add(key)
            else:
                active.discard(key)
        self._key_of = {key[0]: key for key in cur}
        active.intersection_update(cur)
        return cur

    def _run(self) -> None:
        while not self._stop.wait(self.sample_interval_s):
            self._sample(full=False)

    def _sample(self, full: bool) -> None:
        spent0 = time.thread_time()
        prev, prev_own, tally = self._prev, self._prev_own, self._tally
        cur = self._scan(full)
        cur_own = _own_keys(cur, self._root_pids())
        for key, proc in cur.items():
            before = prev.get(key)   # None: born since the last sample, all its time is in the window
            d_self = proc.self_ticks - (before.self_ticks if before else 0)
            if key in cur_own:
                tally.own_ticks += d_self + proc.child_ticks - (before.child_ticks if before else 0)
            elif d_self > 0:
                entry = tally.others_by_proc.setdefault(key, [proc.comm, 0])
                entry[1] += d_self
        # An own process that vanished and was reaped by an own parent: the parent's cutime/cstime
        # just took its whole life, of which the part up to its last read was counted already.
        own_pids = {key[0] for key in cur_own}
        for key in prev_own:
            if key not in cur and prev[key].ppid in own_pids:
                tally.own_ticks -= prev[key].self_ticks + prev[key].child_ticks
        self._prev, self._prev_own = cur, cur_own
        self.samples_taken += 1
        self.sample_cpu_s += time.thread_time() - spent0

    def _reading(self, wall_s: float, cpu1: _CpuTicks) -> HostReading:
        hz, cores = self._ticks_per_s, self._cores
        busy = cpu1.busy - self._cpu0.busy
        total = cpu1.total - self._cpu0.total
        named_ticks = sum(ticks for _, ticks in self._tally.others_by_proc.values())
        others_cpu_s = max(0, busy - self._tally.own_ticks, named_ticks) / hz
        self.own_cpu_s = self._tally.own_ticks / hz
        others_share = others_cpu_s / (wall_s * cores) if wall_s > 0 else 0.0
        steal_share = (cpu1.steal - self._cpu0.steal) / total if total > 0 else 0.0
        ranked = sorted(self._tally.others_by_proc.items(), key=lambda item: -item[1][1])[:self.top_n]
        top = tuple((key[0], comm, ticks / hz) for key, (comm, ticks) in ranked)
        return HostReading(wall_s, cores, others_cpu_s, others_share, steal_share, top,
                           others_share + steal_share > self.threshold)


def speed_benchmark(duration_s: float = 0.25) -> float:
    """A fixed single-thread CPU workload (pure Python loop or a fixed-size numpy/torch matmul at 1 thread)
    timed once; returns work units per second, so drift between probes is visible as a ratio.

    The unit is a fixed pure-Python integer loop (no allocation, no library whose thread count or
    build could change between calls), repeated until duration_s of wall time has passed. Wall time,
    not CPU time: a machine that is slower because of steal or frequency changes shows it here."""
    if not duration_s > 0:
        raise ValueError(f"speed_benchmark duration_s must be positive, got {duration_s}")
    units = 0
    t0 = time.perf_counter()
    deadline = t0 + duration_s
    while True:
        acc = 0
        for i in range(10_000):          # one unit: 10k multiply-add-mod steps
            acc = (acc * 31 + i) % 1_000_003
        units += 1
        now = time.perf_counter()
        if now >= deadline:
            break
    rate = units / (now - t0)
    assert math.isfinite(rate) and rate > 0, rate
    return rate
