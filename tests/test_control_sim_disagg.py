"""The simulator and the planner run serve's disaggregation policy (--disagg-policy): the coordinator's
own DisaggPolicy places each prompt, a prompt kept local is prefilled on the decode instance in its
local-prefill chunks with no KV transfer, and plans name and launch the policy they simulated.
Timelines by hand from step = 10 ms + 1 ms per prefill token + 5 ms per decode."""
from __future__ import annotations

import json

import pytest

from splitserve.cli import main
from splitserve.control.predict import (Arrangement, DisaggSpec, arrangement_from_serve_args, name_of, predict,
                                        simulate)
from splitserve.control.profile_file import parse_profile
from splitserve.control.simulator import Instance, InstanceSpec, Simulation, SimRequest
from splitserve.control.stepmodel import StepModel
from splitserve.coordinator.disagg_policy import DisaggPolicy
from splitserve.trial.spec import SLO
from test_control_plan import PROFILE as PLAN_PROFILE

MODEL = StepModel(overhead_s=0.01, per_prefill_token_s=0.001, per_decode_seq_s=0.005)
TRANSFER_S = 0.05


def run(requests, policy: DisaggPolicy | None, chunk: int | None = 64):
    instances = [Instance("p", InstanceSpec("prefill"), MODEL, num_blocks=1000, block_size=16),
                 Instance("d", InstanceSpec("decode"), MODEL, num_blocks=1000, block_size=16,
                          local_prefill_chunk_tokens=chunk)]
    sim = Simulation(instances, lambda n: TRANSFER_S, disagg=policy)
    sim.run(requests)
    return sim


def token_times(req):
    times = [req.first_s]
    for gap in req.gaps:
        times.append(times[-1] + gap)
    return times


def workload():
    """Chats (32 tokens) and documents (500), far enough apart that each runs alone."""
    return [SimRequest(i, i * 2.0, 500 if i % 2 else 32, 3, "document" if i % 2 else "chat") for i in range(6)]


def test_threshold_prefills_short_prompts_on_the_decode_instance_without_a_transfer():
    requests = workload()
    policy = DisaggPolicy("threshold", local_max_tokens=64)
    sim = run(requests, policy)
    chats = [r for r in requests if r.class_name == "chat"]
    docs = [r for r in requests if r.class_name == "document"]
    assert {r.prefill for r in chats} == {"local"} and {r.prefill for r in docs} == {"remote"}
    assert policy.counts == {("local", "short"): 3, ("remote", "long"): 3}
    assert sim.num_transfers == len(docs), "a prompt prefilled where it decodes moves no KV"
    for chat in chats:
        # one 32-token step on the decode instance, then decodes: no prefill queue, no link in the first gap
        assert token_times(chat) == pytest.approx([chat.arrival_s + x for x in (0.042, 0.057, 0.072)])
    for doc in docs:
        # 510 ms prefill instance's step (its budget of 256 twice: 266 + 254 ms), the transfer in the first gap
        assert doc.first_s - doc.arrival_s == pytest.approx(0.266 + 0.254)
        assert doc.gaps[0] > TRANSFER_S
    assert all(r.finished_s is not None for r in requests)
    assert sim.by_name["p"].free_blocks == sim.by_name["d"].free_blocks == 1000


def test_always_sends_every_prompt_through_the_prefill_instance():
    requests = workload()
    policy = DisaggPolicy("always")
    sim = run(requests, policy)
    assert policy.counts == {("remote", "always"): 6}
    assert all(r.prefill is None for r in requests)  # as serve: `always` reports no placement
    assert sim.num_transfers == 6
    chat = requests[0]
    assert chat.first_s == pytest.approx(0.042) and chat.gaps[0] > TRANSFER_S


def test_a_local_prompt_is_prefilled_in_the_decode_instances_chunks():
    chat = SimRequest(0, 0.0, 48, 2)
    run([chat], DisaggPolicy("threshold", local_max_tokens=64), chunk=16)
    assert chat.prefill == "local"
    assert token_times(chat) == pytest.approx([3 * 0.026, 3 * 0.026 + 0.015])  # 3 chunks of 16, then a decode


def test_a_prompt_refused_for_its_size_leaves_no_pending_local_prefill():
    policy = DisaggPolicy("threshold", local_max_tokens=64)
    instances = [Instance("p", InstanceSpec("prefill"), MODEL, num_blocks=1000, block_size=16),
                 Instance("d", InstanceSpec("decode"), MODEL, num_blocks=2, block_size=16)]
    huge = SimRequest(0, 0.0, 40, 200)
    Simulation(instances, lambda n: TRANSFER_S, disagg=policy).run([huge])
    assert huge.refused and huge.prefill == "local"
    assert not any(policy.pending.values())


PROFILE = parse_profile(PLAN_PROFILE)   # the hand-made profile of test_control_plan.py
PAIR = (InstanceSpec("prefill"), InstanceSpec("decode"))
SLO_ = SLO(ttft_s=8.0, gap_s=0.5, max_pause_s=1.5, e2e_s=30.0)


def test_predict_reports_where_each_class_was_prefilled():
    requests = workload()
    arr = Arrangement("1P1D-threshold", PAIR, disagg=DisaggSpec("threshold", local_prefill_max_tokens=64))
    scored = predict(arr, PROFILE, requests, SLO_)
    assert scored["prefill"] == {"local": 3, "remote": 3}
    assert scored["by_class"]["chat"]["prefill"] == {"local": 3, "remote": 0}
    assert scored["by_class"]["document"]["prefill"] == {"local": 0, "remote": 3}
    plain = predict(Arrangement("1P1D", PAIR), PROFILE, requests, SLO_)
    assert plain["prefill"] == {"local": 0, "remote": 0}  # always: no placement reported
    # the same first token either way (an idle instance, one chunk), but a local chat's answer
    # never waits for a handover
    local, _ = simulate(arr, PROFILE, requests)
    remote, _ = simulate(Arrangement("1P1D", PAIR), PROFILE, requests)
    for a, b in zip(local, remote):
        if a.class_name == "chat":
            assert a.first_s == pytest.approx(b.first_s) and a.finished_s < b.finished_s


def test_auto_in_the_simulator_prefills_a_chat_locally_and_keeps_documents_remote():
    # a chat arrives just after a document: on the prefill instance it would wait ~3.5 s behind it,
    # on the idle decode instance it is prefilled at once. A second document, with the first still
    # on the prefill instance (its TTFT target 1 s missed there), would stall the chat's stream on
    # the decode instance for its many chunks: it stays remote too
    requests = [SimRequest(0, 0.0, 1200, 3, "document"), SimRequest(1, 0.1, 32, 40, "chat"),
                SimRequest(2, 0.3, 1200, 3, "document")]
    for ttft_s in (8.0, 1.0):
        arr = Arrangement("1P1D-auto", PAIR, disagg=DisaggSpec("auto", slo_ttft_s=ttft_s, slo_gap_s=0.5))
        done, _ = simulate(arr, PROFILE, requests)
        by_index = {r.index: r for r in done}
        assert [by_index[i].prefill for i in range(3)] == ["remote", "local", "remote"], ttft_s
        chat = by_index[1]
        assert chat.first_s - chat.arrival_s < 0.5


def test_serve_args_with_a_policy_round_trip_through_the_parser():
    serve = ["--prefill", "1", "--decode", "1", "--threads-per-instance", "1", "--kv-transport", "shm",
             "--disagg-policy", "threshold", "--local-prefill-max-tokens", "128", "--prefill-queue-max-tokens",
             "4000", "--local-prefill-chunk-tokens", "32"]
    arr = arrangement_from_serve_args("1P1D-threshold", serve, 2)
    assert arr.disagg == DisaggSpec("threshold", 128, 4000, 32)
    assert arrangement_from_serve_args("again", arr.serve_args(), 2).disagg == arr.disagg
    auto = arrangement_from_serve_args("1P1D-auto", serve[:8] + ["--disagg-policy", "auto", "--slo-ttft-s", "10",
                                                                 "--slo-gap-s", "0.5"], 2)
    assert auto.disagg == DisaggSpec("auto", slo_ttft_s=10.0, slo_gap_s=0.5)
    assert auto.serve_args()[-8:-4] == ["--slo-ttft-s", "10", "--slo-gap-s", "0.5"]
    adaptive = arrangement_from_serve_args("x", serve[:8] + ["--adaptive", "--slo-ttft-s", "3"], 2)
    assert adaptive.disagg == DisaggSpec() and "--disagg-policy" not in adaptive.serve_args()
    assert name_of(PAIR, "auto") == "1P1D-1t/1t-auto" and name_of(PAIR) == "1P1D-1t/1t"


def test_bad_policy_settings_are_refused_naming_the_flag():
    with pytest.raises(ValueError, match="--disagg-policy must be one of"):
        arrangement_from_serve_args("x", ["--prefill", "1", "--decode", "1", "--disagg-policy", "sometimes"], 2)
    with pytest.raises(ValueError, match="--local-prefill-max-tokens"):
        DisaggSpec("always", local_prefill_max_tokens=64)


def test_plan_tries_each_policy_on_separated_arrangements_and_launches_what_it_simulated(tmp_path, capsys):
    spec = tmp_path / "spec.yaml"
    spec.write_text("""
name: small
seed: 3
workload:
  classes:
    chat: {prompt_tokens: {dist: uniform, min: 32, max: 96}, answer_tokens: 16}
    document: {prompt_tokens: 1200, answer_tokens: 8}
  mix: {chat: 4, document: 1}
arrivals: {pattern: poisson, rate: 0.5, num_requests: 30}
slo: {ttft_s: 8.0, gap_s: 0.5, max_pause_s: 1.5, e2e_s: 30.0}
""")
    profile, out = tmp_path / "profile.json", tmp_path / "plan.json"
    profile.write_text(json.dumps(PROFILE.raw))
    assert main(["plan", str(spec), "--profile", str(profile), "--cores", "2", "--budgets", "256",
                 "--no-capacity", "--min-requests", "30", "--out", str(out)]) == 0
    by_name = {a["name"]: a for a in json.loads(out.read_text())["arrangements"]}
    assert {"1P1D-1t/1t", "1P1D-1t/1t-threshold", "1P1D-1t/1t-auto"} <= set(by_name)
    auto = by_name["1P1D-1t/1t-auto"]
    assert auto["disagg_policy"] == "auto"
    assert auto["serve_args"][auto["serve_args"].index("--disagg-policy"):][:6] == [
        "--disagg-policy", "auto", "--slo-ttft-s", "8", "--slo-gap-s", "0.5"]
    assert by_name["1P1D-1t/1t-threshold"]["predicted"]["by_class"]["chat"]["prefill"]["local"] > 0
    assert by_name["1P1D-1t/1t"]["predicted"]["prefill"] == {"local": 0, "remote": 0}
    rows = {line.split()[1]: line.split()[-1] for line in capsys.readouterr().out.splitlines()
            if line[:3].strip().isdigit()}
    share = by_name["1P1D-1t/1t-threshold"]["predicted"]["prefill"]
    assert rows["1P1D-1t/1t-threshold"] == f"{share['local'] / (share['local'] + share['remote']):.0%}"
    assert rows["1P1D-1t/1t"] == "-" and rows["colocated-chunked256-2x1t"] == "-"
    assert main(["plan", str(spec), "--profile", str(profile), "--disagg-policies", "always,sometimes",
                 "--no-capacity", "--out", str(out)]) == 2
