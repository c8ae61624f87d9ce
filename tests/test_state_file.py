"""`serve --state-file`: the arrangement the admin API changed survives a restart of `serve`.

A role changed through the admin API is written to the state file at once (a whole JSON file
after every change), and a `serve` started again with the same command line comes back with the
changed role, and says so. A corrupt state file, or one for another model, is not used: a
warning says why, the command line's arrangement starts, and the file is kept aside. The watcher
that writes the file keeps what this process started and did not drain, dead or alive.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from types import SimpleNamespace

import httpx
import pytest

from serve_disagg_support import DisaggServer, completion_body
from serve_support import wait_until
from tiny_models import write_tiny_checkpoint

from splitserve.entrypoints.state_file import (ArrangementWatcher, StateRejected, check_state_path, read_arrangement,
                                               restore_arrangement, write_arrangement)

COMMAND_LINE = [("prefill-0", "prefill"), ("decode-0", "decode")]


def saved(path) -> dict:
    return json.loads(path.read_text())


# ---- the file -----------------------------------------------------------------------------

def test_a_written_arrangement_reads_back_for_the_same_model_and_leaves_no_temp_file(tmp_path):
    path = tmp_path / "state.json"
    write_arrangement(str(path), "some/model", [("prefill-0", "colocated"), ("decode-0", "decode")])
    assert read_arrangement(str(path), "some/model") == [("prefill-0", "colocated"), ("decode-0", "decode")]
    assert saved(path)["instances"] == [{"id": "prefill-0", "role": "colocated"}, {"id": "decode-0", "role": "decode"}]
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]
    assert read_arrangement(str(tmp_path / "absent.json"), "some/model") is None


def test_a_local_model_is_the_same_model_by_any_path_to_it(tmp_path, monkeypatch):
    (tmp_path / "ckpt").mkdir()
    path = tmp_path / "state.json"
    write_arrangement(str(path), str(tmp_path / "ckpt"), COMMAND_LINE)
    monkeypatch.chdir(tmp_path)
    assert read_arrangement(str(path), "ckpt") == COMMAND_LINE


@pytest.mark.parametrize("content,why", [
    (b"{\"version\": 1, \"model\": \"some/mo", "not a splitserve state file"),
    (b"\x00\xff garbage", "not a splitserve state file"),
    (b"[1, 2, 3]", "not a splitserve state file"),
    (b'{"version": 1, "model": "some/model", "instances": [{"id": "a"}]}', "not a splitserve state file"),
    (b'{"version": 9, "model": "some/model", "instances": []}', "version 9"),
    (b'{"version": 1, "model": "other/model", "instances": [{"id": "a", "role": "colocated"}]}', "other/model"),
    (b'{"version": 1, "model": "some/model", "instances": []}', "no instance"),
    (b'{"version": 1, "model": "some/model", "instances": [{"id": "a", "role": "teacher"}]}', "teacher"),
    (b'{"version": 1, "model": "some/model", "instances": [{"id": "a", "role": "prefill"}]}', "none could decode"),
    (b'{"version": 1, "model": "some/model", "instances": [{"id": "../x", "role": "colocated"}]}', "engine id"),
    (b'{"version": 1, "model": "some/model", "instances": [{"id": "a", "role": "colocated"}, '
     b'{"id": "a", "role": "colocated"}]}', "twice"),
])
def test_an_unusable_state_file_is_rejected_with_the_reason(tmp_path, content, why):
    path = tmp_path / "state.json"
    path.write_bytes(content)
    with pytest.raises(StateRejected, match=why):
        read_arrangement(str(path), "some/model")


def test_a_rejected_file_falls_back_to_the_command_line_with_a_warning_and_is_kept_aside(tmp_path, caplog):
    path = tmp_path / "state.json"
    path.write_bytes(b"not json")
    with caplog.at_level(logging.WARNING):
        assert restore_arrangement(str(path), "some/model", COMMAND_LINE, set()) == COMMAND_LINE
    assert "not used" in caplog.text and "not a splitserve state file" in caplog.text
    assert "prefill-0 (prefill), decode-0 (decode)" in caplog.text
    assert not path.exists() and (tmp_path / "state.json.rejected").read_bytes() == b"not json"


def test_a_saved_arrangement_replaces_the_command_lines_unless_it_clashes(tmp_path, caplog):
    path = tmp_path / "state.json"
    write_arrangement(str(path), "some/model", [("prefill-0", "prefill"), ("prefill-1", "prefill"), ("decode-0", "decode")])
    with caplog.at_level(logging.WARNING):
        roles = restore_arrangement(str(path), "some/model", COMMAND_LINE, set())
    assert roles == [("prefill-0", "prefill"), ("prefill-1", "prefill"), ("decode-0", "decode")]
    assert "restoring the arrangement saved in" in caplog.text
    # two prefill instances cannot share a fixed KV port; a topology's remote ids are not ours
    assert restore_arrangement(str(path), "some/model", COMMAND_LINE, set(), kv_port=7000) == COMMAND_LINE
    write_arrangement(str(path), "some/model", COMMAND_LINE)
    assert restore_arrangement(str(path), "some/model", [("prefill-0", "prefill")], {"decode-0"}) == [("prefill-0", "prefill")]


def test_a_state_file_in_a_missing_folder_is_refused_before_anything_starts(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        check_state_path(str(tmp_path / "nope" / "state.json"))
    with pytest.raises(ValueError, match="directory"):
        check_state_path(str(tmp_path))


# ---- the watcher ----------------------------------------------------------------------------

@dataclass
class FakeInstance:
    hello: SimpleNamespace
    alive: bool = True
    removed: bool = False


def fake_client(**roles):
    instances = {i: FakeInstance(SimpleNamespace(role=r)) for i, r in roles.items()}
    router = SimpleNamespace(instances={i: SimpleNamespace(draining=False) for i in roles})
    return SimpleNamespace(instances=instances, router=router)


def test_the_watcher_keeps_what_serve_started_and_did_not_drain_dead_or_alive(tmp_path):
    path = tmp_path / "state.json"
    client = fake_client(**{"prefill-0": "prefill", "decode-0": "decode", "by-hand": "decode"})
    owned = dict.fromkeys(["prefill-0", "decode-0"])  # as serve keeps them: in the order it started them
    watcher = ArrangementWatcher(client, str(path), "m", owned)
    watcher.save_if_changed()
    assert read_arrangement(str(path), "m") == COMMAND_LINE  # the hand-started engine is not ours
    client.instances["prefill-0"].hello.role = "colocated"  # a live role change
    client.instances["decode-0"].alive = False  # died: serve would start it again
    client.instances["added-1"] = FakeInstance(SimpleNamespace(role="decode"))
    client.router.instances["added-1"] = SimpleNamespace(draining=False)
    owned["added-1"] = None
    watcher.save_if_changed()
    assert read_arrangement(str(path), "m") == [("prefill-0", "colocated"), ("decode-0", "decode"), ("added-1", "decode")]
    client.router.instances["added-1"].draining = True  # DELETE /admin/instances/added-1
    watcher.save_if_changed()
    assert read_arrangement(str(path), "m") == [("prefill-0", "colocated"), ("decode-0", "decode")]


def test_nothing_is_written_before_every_started_instance_said_hello_and_rows_keep_serves_order(tmp_path):
    """A file written when only the decode instance had said hello would bring back half the
    arrangement after a restart; and the hellos' order (a race) must not reorder the file."""
    path = tmp_path / "state.json"
    client = fake_client(**{"decode-0": "decode"})            # prefill-0 has not said hello yet
    watcher = ArrangementWatcher(client, str(path), "m", dict.fromkeys(["prefill-0", "decode-0"]))
    watcher.save_if_changed()
    assert not path.exists()
    client.instances["prefill-0"] = FakeInstance(SimpleNamespace(role="prefill"))
    client.router.instances["prefill-0"] = SimpleNamespace(draining=False)
    watcher.save_if_changed()
    assert read_arrangement(str(path), "m") == COMMAND_LINE   # serve's order, not the hellos'
    client.instances["prefill-0"].hello.role = "colocated"    # a live role change is saved
    watcher.save_if_changed()
    assert read_arrangement(str(path), "m") == [("prefill-0", "colocated"), ("decode-0", "decode")]
    del client.instances["decode-0"]                          # gone after its hello: the rest is saved
    watcher.save_if_changed()
    assert read_arrangement(str(path), "m") == [("prefill-0", "colocated")]
    client.instances["prefill-0"].hello.role = "prefill"      # no decode stage left: not restorable,
    watcher.save_if_changed()                                 # so the last one that is stays
    assert read_arrangement(str(path), "m") == [("prefill-0", "colocated")]


def test_a_state_file_that_cannot_be_written_is_logged_once_and_serving_goes_on(tmp_path, caplog):
    client = fake_client(**{"engine-0": "colocated"})
    watcher = ArrangementWatcher(client, str(tmp_path / "gone" / "state.json"), "m", dict.fromkeys(["engine-0"]))
    with caplog.at_level(logging.ERROR):
        watcher.save_if_changed()
        watcher.save_if_changed()
    assert caplog.text.count("cannot write the state file") == 1


# ---- a real server ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(write_tiny_checkpoint(tmp_path_factory.mktemp("state") / "tiny", arch="llama"))


def instance_roles(srv) -> dict[str, str]:
    rows = httpx.get(srv.base_url + "/admin/instances", timeout=10).json()["instances"]
    return {i["id"]: i["role"] for i in rows if i["alive"]}


def answered(srv) -> bool:
    r = httpx.post(srv.base_url + "/v1/completions", json=completion_body([5, 6, 7, 8], 8, stream=False), timeout=60)
    return r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8


def test_a_role_changed_through_the_admin_api_survives_a_restart_of_serve(model, tmp_path):
    path = tmp_path / "state.json"
    argv = ("--prefill", "1", "--decode", "1", "--kv-transport", "shm", "--state-file", str(path))
    srv = DisaggServer(model, *argv, log_path=tmp_path / "first.log").wait_ready()
    try:
        assert wait_until(lambda: path.exists(), timeout_s=20)
        assert read_arrangement(str(path), model) == COMMAND_LINE
        r = httpx.post(srv.base_url + "/admin/instances/prefill-0/role", json={"role": "colocated"}, timeout=90)
        assert r.status_code == 200, r.text
        changed = [("prefill-0", "colocated"), ("decode-0", "decode")]
        assert wait_until(lambda: read_arrangement(str(path), model) == changed, timeout_s=20), path.read_text()
        assert answered(srv)
    finally:
        assert srv.stop() == 0
    assert read_arrangement(str(path), model) == changed  # the engines' exits at shutdown change nothing

    again = DisaggServer(model, *argv, log_path=tmp_path / "second.log").wait_ready()
    try:
        assert instance_roles(again) == {"prefill-0": "colocated", "decode-0": "decode"}
        assert "restoring the arrangement saved in" in again.text()
        assert answered(again)
    finally:
        again.stop()
    assert read_arrangement(str(path), model) == changed


def test_a_corrupt_state_file_gets_a_clear_warning_and_the_command_lines_arrangement(model, tmp_path):
    path = tmp_path / "state.json"
    path.write_text('{"version": 1, "model": ')
    srv = DisaggServer(model, "--instances", "1", "--state-file", str(path), log_path=tmp_path / "serve.log").wait_ready()
    try:
        assert instance_roles(srv) == {"engine-0": "colocated"}
        log = srv.text()
        assert f"the state file {path} is not used: it is not a splitserve state file" in log
        assert "Traceback" not in log
        assert (tmp_path / "state.json.rejected").read_text() == '{"version": 1, "model": '
        assert wait_until(lambda: path.exists() and read_arrangement(str(path), model) == [("engine-0", "colocated")],
                          timeout_s=20)
        assert answered(srv)
    finally:
        srv.stop()
