"""An arrangement whose engines sit on different hosts, joined by a link of a given speed.

    arrangements:
      - name: 1P1D-across-1gbit
        serve: [--prefill, 1, --decode, 1, --threads-per-instance, 1]
        hosts: {prefill: a, decode: b}   # each role's instances on a host of the bed
        link: 1gbit                      # every host's link (tc rate: 100mbit .. 10gbit)
        backup: true                     # a bulk TCP flow prefill host -> decode host shares it
        cores: 2

The trial builds the bed (splitserve/testbed/netbed.py: network namespaces on this machine,
links shaped by tc), starts the frontend in the root namespace and each engine inside its host
(testbed/across.py: `serve --topology`, KV over tcp with its secret), and tears all of it down
after the arrangement's runs. The link goes into the results and the verdict, so a comparison
says what the separated arrangement paid for crossing it. Needs root (network namespaces).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import re
from dataclasses import dataclass

from splitserve.trial.section import Section, SpecError

ROLE_FLAGS = {"prefill": "--prefill", "decode": "--decode", "colocated": "--instances"}


@dataclass(slots=True, frozen=True)
class Network:
    hosts: dict[str, str]   # role -> bed host
    link: str               # tc rate, e.g. "1gbit"
    backup: bool = False    # a bulk flow from the prefill host to the decode host

    def describe(self) -> str:
        where = ", ".join(f"{role} on host {host}" for role, host in self.hosts.items())
        text = f"{where}, {self.link} links"
        if self.backup:
            text += f" shared with a bulk backup flow {self.hosts.get('prefill')} -> {self.hosts.get('decode')}"
        return text


def read_network(sec: Section, name: str, serve_args: list[str] | None) -> Network | None:
    """The arrangement's `hosts`, `link` and `backup` fields; None when it names no hosts."""
    raw_hosts = sec.section("hosts", required=False)
    link, backup = sec.str("link", default=None), sec.bool("backup", default=False)
    where = f"{sec.path}hosts"
    if raw_hosts.empty:
        if link is not None or backup:
            raise SpecError(f"{sec.path}link/backup: only for an arrangement across hosts; add "
                            f"hosts: {{prefill: a, decode: b}}")
        return None
    hosts = {role: raw_hosts.str(role) for role in raw_hosts.keys()}
    unknown = set(hosts) - set(ROLE_FLAGS)
    if unknown:
        raise SpecError(f"{where}: roles are {', '.join(ROLE_FLAGS)}, got {sorted(unknown)}")
    for role, host in hosts.items():
        if not re.fullmatch(r"[a-z0-9]{1,8}", host):
            raise SpecError(f"{where}.{role}: a host is 1-8 lowercase letters or digits, got {host!r}")
    if serve_args is None or "--topology" in serve_args:
        raise SpecError(f"{where}: an arrangement across hosts is launched from `serve` arguments "
                        f"(e.g. [--prefill, 1, --decode, 1]); the trial writes the topology itself")
    started = {role for role, flag in ROLE_FLAGS.items() if _count(serve_args, flag)}
    if role_missing := started - set(hosts):
        raise SpecError(f"{where}: arrangement {name} starts {sorted(role_missing)} instances; name their host")
    if _flag_value(serve_args, "--kv-transport") not in (None, "tcp"):
        raise SpecError(f"{sec.path}serve: across hosts KV moves over tcp; drop --kv-transport")
    if link is None:
        raise SpecError(f"{sec.path}link: give the hosts' link speed, e.g. link: 1gbit")
    if backup and not {"prefill", "decode"} <= set(hosts):
        raise SpecError(f"{sec.path}backup: the backup flow runs from the prefill host to the decode host; "
                        "name both in hosts")
    from splitserve.testbed.netbed import LinkSpec
    try:
        LinkSpec.parse(link)
    except ValueError as e:
        raise SpecError(f"{sec.path}link: {e}") from None
    return Network(hosts, link, backup)


def _flag_value(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args and args.index(flag) + 1 < len(args) else None


def _count(args: list[str], flag: str) -> int:
    value = _flag_value(args, flag)
    return int(value) if value is not None and value.isdigit() else 0


def split_serve_args(serve_args: list[str]) -> tuple[dict[str, tuple[str, str]], list[str], list[str]]:
    """(instance roles, engine flags, frontend flags) of `serve` arguments: engines get the flags
    `splitserve engine` knows (threads, KV memory, token budget, ...), the frontend the rest."""
    from splitserve.engine.process import add_engine_arguments

    parser = argparse.ArgumentParser(add_help=False)
    add_engine_arguments(parser)
    known = parser._option_string_actions
    counts = {role: _count(serve_args, flag) for role, flag in ROLE_FLAGS.items()}
    engine, frontend, i = [], [], 0
    while i < len(serve_args):
        token = serve_args[i]
        takes_value = token in known and known[token].nargs != 0
        if token not in known and token in ROLE_FLAGS.values():
            takes_value = True
        width = 2 if takes_value else 1
        part = serve_args[i:i + width]
        if token in ROLE_FLAGS.values() or token == "--kv-transport":
            pass  # the placement and the transport are the trial's
        elif token in known:
            engine += part
        else:
            frontend += part
        i += width
    roles = {f"{role}-{n}": role for role, count in counts.items() for n in range(count)}
    return roles, engine, frontend


@contextlib.contextmanager
def launched_across(network: Network, serve_args: list[str], model: str | None, log_path, startup_timeout_s: float,
                    cpus: list[int] | None):
    """Yield (base_url, frontend pid) with the arrangement running on the bed; tear all of it down after."""
    from splitserve.testbed.across import serve_across
    from splitserve.testbed.netbed import LinkSpec, NetBed

    roles, engine_args, frontend_args = split_serve_args(serve_args)
    placement = {engine_id: (role, network.hosts[role]) for engine_id, role in roles.items()}
    pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    hosts = tuple(sorted(set(network.hosts.values())))
    with NetBed(hosts, LinkSpec.parse(network.link)) as bed:
        with serve_across(bed, placement, model, frontend_args, engine_args, log_path=log_path,
                          startup_timeout_s=startup_timeout_s, preexec_fn=pin) as server:
            if network.backup:
                bed.bulk_flow(network.hosts["prefill"], network.hosts["decode"])
            yield server.base_url, server.serve.pid
