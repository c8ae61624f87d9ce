"""Equal resources, enforced: every arrangement gets the same cores and the same total KV memory.

- Cores: each arrangement's engines use instances x threads cores (read from its `serve`
  arguments, or its `cores` field); a spec whose arrangements differ is refused, naming them.
  The launched server (frontend and engines: engines inherit the affinity) is pinned with
  sched_setaffinity to the same first N cores of the trial's own affinity in every arrangement,
  and each launched process's affinity is read back (psutil) into the report.
- KV memory: the spec's `kv_cache_memory` is the total per arrangement; the trial passes
  `--kv-cache-memory total / instances` to each `serve` arrangement that does not set it.
- The load generator is this process, left where it runs (same for every arrangement).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace

from splitserve.config import parse_size
from splitserve.trial.section import SpecError
from splitserve.trial.spec import Arrangement, TrialSpec


@dataclass(slots=True)
class Resources:
    instances: str                 # "1 colocated", "1 prefill + 1 decode"
    num_instances: int | None
    threads_per_instance: int | None
    cores: int | None
    kv_per_instance: int | None    # bytes
    kv_total: int | None

    def describe(self) -> str:
        threads = f"{self.threads_per_instance} thread(s) each" if self.threads_per_instance else "threads unknown"
        kv = (f"KV {self.kv_total / 2**20:.0f} MiB ({self.kv_per_instance / 2**20:.0f} MiB each)"
              if self.kv_total else "KV unknown")
        cores = f"{self.cores} cores" if self.cores else "cores unknown"
        return f"{self.instances}, {threads}: {cores}, {kv}"


def _flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args and args.index(name) + 1 < len(args) else None


def _int_flag(args: list[str], name: str, arr: Arrangement) -> int | None:
    value = _flag(args, name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise SpecError(f"arrangements ({arr.name}).serve: {name} needs a whole number, got {value!r}") from None


def arrangement_resources(arr: Arrangement) -> Resources:
    """What the arrangement's engines use, from its serve arguments (external ones: its `cores`)."""
    if arr.serve_args is None or "--topology" in arr.serve_args:
        return Resources("external" if arr.url else "as its command starts", None, None, arr.cores, None, None)
    args = arr.serve_args
    prefill, decode = _int_flag(args, "--prefill", arr) or 0, _int_flag(args, "--decode", arr) or 0
    if prefill or decode:
        num, label = prefill + decode, f"{prefill} prefill + {decode} decode"
    else:
        num = _int_flag(args, "--instances", arr) or 1
        label = f"{num} {'adaptive' if '--adaptive' in args else 'colocated'}"
    threads = _int_flag(args, "--threads-per-instance", arr)
    if threads is None and arr.cores is not None:
        threads = max(arr.cores // num, 1)   # serve's own default: its cores shared between engines
    cores = num * threads if threads else arr.cores
    kv = _flag(args, "--kv-cache-memory")
    kv_each = parse_size(kv) if kv is not None else None
    return Resources(label, num, threads, cores, kv_each, kv_each * num if kv_each else None)


def check_equal(spec: TrialSpec) -> dict[str, Resources]:
    """Refuse arrangements that do not add up to the same cores (or declare one thing and run
    another); returns each one's resources."""
    out = {}
    for arr in spec.arrangements:
        res = arrangement_resources(arr)
        if arr.cores is not None and res.cores is not None and res.cores != arr.cores:
            raise SpecError(f"arrangements ({arr.name}): says cores: {arr.cores} but its serve arguments start "
                            f"{res.instances} with {res.threads_per_instance} thread(s) each = {res.cores} cores")
        out[arr.name] = res
    if spec.allow_unequal_cores:
        return out
    cores = {name: r.cores for name, r in out.items() if r.cores is not None}
    if len(set(cores.values())) > 1:
        raise SpecError(f"arrangements: they must use the same cores to be compared, got "
                        f"{', '.join(f'{n} {c}' for n, c in cores.items())}; fix their threads or instances, "
                        f"or set allow_unequal_cores: true")
    kv = {name: r.kv_total for name, r in out.items() if r.kv_total is not None}
    if len(set(kv.values())) > 1:
        raise SpecError(f"arrangements: total KV cache memory differs, got "
                        f"{', '.join(f'{n} {v / 2**20:.0f} MiB' for n, v in kv.items())}; drop --kv-cache-memory "
                        f"from their serve arguments and set kv_cache_memory (the total) in the spec")
    return out


def with_kv_split(arr: Arrangement, total: str) -> Arrangement:
    """The arrangement with --kv-cache-memory = total / instances, unless it sets its own."""
    if arr.serve_args is None or "--kv-cache-memory" in arr.serve_args or "--topology" in arr.serve_args:
        return arr
    num = arrangement_resources(arr).num_instances or 1
    return replace(arr, serve_args=[*arr.serve_args, "--kv-cache-memory", str(parse_size(total) // num)])


def core_set(cores: int | None) -> list[int]:
    """The first `cores` CPUs this process may use: the same set for every arrangement."""
    available = sorted(os.sched_getaffinity(0))
    if cores is None:
        return available
    if cores > len(available):
        raise SpecError(f"arrangements: they use {cores} cores but the trial may run on only {len(available)} "
                        f"({available}); lower their threads or run on a larger machine")
    return available[:cores]


def read_affinity(pid: int) -> list[dict]:
    """Each process of a launched server (it and its descendants) with the CPUs it may run on."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return []
    out = []
    for p in procs:
        try:
            cmd = p.cmdline()
            role = next((cmd[i + 1] for i, a in enumerate(cmd[:-1]) if a == "--engine-id"), None)
            out.append({"pid": p.pid, "process": role or ("server" if p.pid == pid else p.name()),
                        "cpus": sorted(p.cpu_affinity()), "threads": p.num_threads()})
        except psutil.Error:
            continue
    return out
