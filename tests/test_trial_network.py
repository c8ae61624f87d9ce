"""A trial arrangement across hosts: the spec names each role's host, the link and a backup
flow; mistakes fail before anything starts; the verdict says which arrangements crossed a link."""
import copy

import pytest

from splitserve.trial.network import split_serve_args
from splitserve.trial.spec import SpecError, parse_spec
from splitserve.trial.verdict import _network

SPEC = {
    "name": "t", "seed": 1,
    "workload": {"classes": {"chat": {"prompt_tokens": 16, "answer_tokens": 4}}},
    "arrivals": {"pattern": "poisson", "rate": 2.0, "num_requests": 10},
    "slo": {"ttft_s": 1.0, "gap_s": 0.2, "max_pause_s": 1.0, "e2e_s": 10.0},
    "arrangements": [
        {"name": "colocated", "serve": ["--instances", "1", "--threads-per-instance", "2"], "cores": 2},
        {"name": "1P1D-across", "serve": ["--prefill", "1", "--decode", "1", "--threads-per-instance", "1"],
         "hosts": {"prefill": "a", "decode": "b"}, "link": "100mbit", "backup": True, "cores": 2}],
}


def across(**changes) -> dict:
    raw = copy.deepcopy(SPEC)
    arr = raw["arrangements"][1]
    for key, value in changes.items():
        if value is None:
            arr.pop(key, None)
        else:
            arr[key] = value
    return raw


def test_an_arrangement_names_its_hosts_link_and_backup():
    spec = parse_spec(SPEC)
    colocated, split = spec.arrangements
    assert colocated.network is None
    assert split.network.hosts == {"prefill": "a", "decode": "b"} and split.network.link == "100mbit"
    assert split.network.describe() == ("prefill on host a, decode on host b, 100mbit links shared with a bulk "
                                        "backup flow a -> b")


@pytest.mark.parametrize("changes, message", [
    ({"hosts": None}, "only for an arrangement across hosts"),
    ({"hosts": {"prefill": "a"}}, "starts ['decode'] instances; name their host"),
    ({"hosts": {"prefill": "a", "decode": "B!"}}, "lowercase letters or digits"),
    ({"hosts": {"prefill": "a", "decode": "b", "router": "c"}}, "roles are prefill, decode, colocated"),
    ({"link": None}, "give the hosts' link speed"),
    ({"link": "fast"}, "e.g. 100mbit"),
    ({"serve": ["--prefill", "1", "--decode", "1", "--kv-transport", "shm"]}, "KV moves over tcp"),
    ({"hosts": {"colocated": "a"}, "serve": ["--instances", "1", "--threads-per-instance", "2"]},
     "the backup flow runs from the prefill host to the decode host"),
])
def test_a_wrong_network_field_fails_before_anything_starts(changes, message):
    with pytest.raises(SpecError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_spec(across(**changes))


def test_serve_arguments_split_into_placement_engine_flags_and_frontend_flags():
    roles, engine, frontend = split_serve_args(
        ["--prefill", "1", "--decode", "2", "--threads-per-instance", "1", "--kv-transport", "tcp",
         "--prefix-affinity", "--kv-cache-memory", "512MiB", "--engine-silence-timeout", "3"])
    assert roles == {"prefill-0": "prefill", "decode-0": "decode", "decode-1": "decode"}
    assert engine == ["--threads-per-instance", "1", "--kv-cache-memory", "512MiB"]
    assert frontend == ["--prefix-affinity", "--engine-silence-timeout", "3"]


def test_the_verdict_names_the_link_of_every_arrangement_across_hosts():
    doc = {"arrangements": [{"name": "colocated", "network": None},
                            {"name": "1P1D-across", "network": "prefill on host a, decode on host b, 1gbit links"}]}
    assert _network(doc) == (" Across hosts: 1P1D-across (prefill on host a, decode on host b, 1gbit links); "
                             "the others ran on one host.")
    assert _network({"arrangements": [{"name": "colocated"}]}) == ""
