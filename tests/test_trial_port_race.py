"""The trial picks a free port and the server binds it a moment later; another process can take it
in between. A launch that exits saying so is started again on another port; any other failure is not."""
import sys

import httpx
import pytest

from splitserve.trial.arrangements import PORT_RACE_TRIES, LaunchError, launched
from splitserve.trial.spec import Arrangement

from test_trial_end_to_end import FAKE


def taken_first(mark, times: int) -> list[str]:
    """A server command that says its port is in use on its first `times` launches, then serves."""
    script = (f'n=$(cat "{mark}" 2>/dev/null || echo 0); echo $((n + 1)) > "{mark}"; '
              f'if [ "$n" -lt {times} ]; then echo "OSError: [Errno 98] Address already in use" >&2; exit 1; fi; '
              f'exec "{sys.executable}" "{FAKE}" --port {{port}}')
    return ["sh", "-c", script]


@pytest.mark.timeout(120)
def test_a_server_whose_port_was_taken_is_started_again_on_another_port(tmp_path):
    arr = Arrangement("raced", command=taken_first(tmp_path / "launches", 1))
    with launched(arr, None, tmp_path / "logs") as endpoint:
        assert httpx.get(endpoint.base_url + "/v1/models", timeout=10).status_code == 200
    logs = sorted(p.name for p in (tmp_path / "logs").glob("raced*.log"))
    assert logs == ["raced.1.log", "raced.log"]  # each launch's log kept
    assert "Address already in use" in (tmp_path / "logs" / "raced.log").read_text()
    assert (tmp_path / "launches").read_text().strip() == "2"


@pytest.mark.timeout(120)
def test_relaunches_on_a_taken_port_are_bounded(tmp_path):
    arr = Arrangement("always", command=taken_first(tmp_path / "launches", 99))
    with pytest.raises(LaunchError, match="Address already in use"):
        with launched(arr, None, tmp_path / "logs"):
            pass
    assert (tmp_path / "launches").read_text().strip() == str(PORT_RACE_TRIES)


@pytest.mark.timeout(60)
def test_a_server_that_fails_for_another_reason_is_not_started_again(tmp_path):
    mark = tmp_path / "launches"
    arr = Arrangement("broken", command=["sh", "-c", f'echo x >> "{mark}"; echo "no model here" >&2; exit 1'])
    with pytest.raises(LaunchError, match="no model here"):
        with launched(arr, None, tmp_path / "logs"):
            pass
    assert mark.read_text().count("x") == 1
