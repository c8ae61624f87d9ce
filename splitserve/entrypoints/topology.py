"""`splitserve serve --topology FILE`: which engine instances a server has, and where they run.

    engine_address: tcp://0.0.0.0:5555     # optional: where engines connect (default: --engine-address)
    instances:
      - {id: prefill-0, role: prefill}                 # host omitted or "local": serve starts it
      - {id: decode-0, role: decode}
      - {id: decode-gpu1, role: decode, host: 10.0.0.7}  # started there by hand; serve waits for it

For every instance on another host, serve prints the `splitserve engine` command to run there
and waits (up to --startup-timeout) until it joins. Across hosts KV moves over tcp (start serve
with --kv-transport tcp too); an engine address reachable from other hosts needs
--engine-secret-file, and a prefill instance serving KV to other hosts needs --kv-host and
--kv-secret-file (each refuses to start otherwise). Tested across network namespaces joined by
shaped links (splitserve/testbed/, docs/multihost.md). With `serve --ray` nothing is started by
hand: Ray places every instance, one with a `host` on the Ray node of that address
(cluster/ray_placement.py).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from splitserve.config import ROLES

_ID = re.compile(r"^[A-Za-z0-9._\-]{1,64}$")


@dataclass(slots=True, frozen=True)
class TopologyInstance:
    id: str
    role: str
    host: str = "local"

    @property
    def is_local(self) -> bool:
        return self.host in ("local", "localhost", "127.0.0.1")


@dataclass(slots=True, frozen=True)
class Topology:
    instances: tuple[TopologyInstance, ...]
    engine_address: str | None = None

    @property
    def local(self) -> list[TopologyInstance]:
        return [i for i in self.instances if i.is_local]

    @property
    def remote(self) -> list[TopologyInstance]:
        return [i for i in self.instances if not i.is_local]


def parse_topology(data: object, where: str = "topology") -> Topology:
    """Raises ValueError naming the field and the fix."""
    if not isinstance(data, dict) or not isinstance(data.get("instances"), list) or not data["instances"]:
        raise ValueError(f"{where}: expected a mapping with a non-empty 'instances' list, e.g. "
                         "instances: [{id: prefill-0, role: prefill}, {id: decode-0, role: decode}]")
    unknown = set(data) - {"instances", "engine_address"}
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {sorted(unknown)}; allowed: instances, engine_address")
    instances = []
    for n, item in enumerate(data["instances"]):
        field = f"{where}: instances[{n}]"
        if not isinstance(item, dict) or set(item) - {"id", "role", "host"}:
            raise ValueError(f"{field}: expected a mapping with id, role and optional host")
        engine_id, role, host = item.get("id"), item.get("role"), item.get("host", "local")
        if not isinstance(engine_id, str) or not _ID.match(engine_id):
            raise ValueError(f"{field}.id: give a name of letters, digits, '.', '_' or '-', got {engine_id!r}")
        if role not in ROLES:
            raise ValueError(f"{field}.role: must be one of {', '.join(ROLES)}, got {role!r}")
        if not isinstance(host, str) or not host:
            raise ValueError(f"{field}.host: give a host name or 'local', got {host!r}")
        instances.append(TopologyInstance(engine_id, role, host))
    ids = [i.id for i in instances]
    duplicate = next((i for i in ids if ids.count(i) > 1), None)
    if duplicate:
        raise ValueError(f"{where}: instance id {duplicate!r} appears twice; ids must be unique")
    roles = {i.role for i in instances}
    if ("prefill" in roles) != ("decode" in roles):
        missing = "decode" if "prefill" in roles else "prefill"
        raise ValueError(f"{where}: prefill and decode instances come in pairs; add a {missing} instance")
    address = data.get("engine_address")
    if address is not None and not (isinstance(address, str) and address.startswith("tcp://")):
        raise ValueError(f"{where}: engine_address must look like tcp://HOST:PORT, got {address!r}")
    return Topology(tuple(instances), address)


def load_topology(path: str | Path) -> Topology:
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ValueError(f"--topology: cannot read {path}: {e.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"--topology {path}: not valid YAML: {e}") from None
    return parse_topology(data, f"--topology {path}")


def hand_start_command(instance: TopologyInstance, address: str, model: str | None) -> str:
    """What to run on the instance's host so that it joins this server."""
    cmd = f"splitserve engine --role {instance.role} --engine-id {instance.id} --connect {address}"
    if model:
        cmd += f" --model {model}"
    if instance.role == "prefill":  # serves its KV to other hosts
        cmd += " --kv-transport tcp --kv-host <this host's address> --kv-secret-file <shared secret file>"
    elif instance.role == "decode":  # pulls KV across hosts: shm works on one host only
        cmd += " --kv-transport tcp --kv-secret-file <shared secret file>"
    return cmd
