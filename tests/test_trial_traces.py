"""Each trace format parses from a small fixture; `workload analyze` reads them and the real Azure trace."""
import json
import pathlib

import pytest

from splitserve.trial.analyze import analyze, read_requests
from splitserve.trial.traces import TraceError, detect_format, read_trace

# shipped with the examples (CC-BY 4.0, attribution in examples/traces/README.md)
AZURE_TRACE = pathlib.Path(__file__).resolve().parents[1] / "examples/traces/AzureLLMInferenceTrace_conv.csv"


@pytest.fixture
def azure(tmp_path):
    p = tmp_path / "azure.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                 "2023-11-16 18:15:46.6805900,374,44\n"
                 "2023-11-16 18:15:50.9951690,396,109\n"
                 "2023-11-16 18:15:46.1805900,2000,5\n")  # out of order: sorted on read
    return p


@pytest.fixture
def burstgpt(tmp_path):
    p = tmp_path / "burst.csv"
    p.write_text("Timestamp,Session ID,Elapsed time,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                 "5,1,0.9,ChatGPT,472,18,490,Conversation log\n"
                 "7.5,2,1.2,GPT-4,1200,0,1200,Conversation log\n"     # failed: 0 response tokens
                 "9,3,2.0,ChatGPT,30,250,280,API log\n")
    return p


@pytest.fixture
def mooncake(tmp_path):
    p = tmp_path / "mooncake.jsonl"
    rows = [{"timestamp": 0, "input_length": 6955, "output_length": 52, "hash_ids": [0, 1]},
            {"timestamp": 3000, "input_length": 300, "output_length": 10, "hash_ids": [2]},
            {"timestamp": 3000, "input_length": 50, "output_length": 7, "hash_ids": []}]
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return p


def test_azure_rows_become_relative_seconds_sorted(azure):
    recs = read_trace(azure)
    assert detect_format(azure) == "azure"
    assert [(round(r.time_s, 4), r.prompt_tokens, r.answer_tokens) for r in recs] == [
        (0.0, 2000, 5), (0.5, 374, 44), (4.8146, 396, 109)]


def test_burstgpt_skips_failed_requests_unless_asked(burstgpt):
    assert detect_format(burstgpt) == "burstgpt"
    assert [(r.time_s, r.prompt_tokens, r.answer_tokens) for r in read_trace(burstgpt)] == [
        (0.0, 472, 18), (4.0, 30, 250)]
    assert len(read_trace(burstgpt, skip_failed=False)) == 3


def test_mooncake_milliseconds_become_seconds_and_buckets_stay_bursts(mooncake):
    recs = read_trace(mooncake)
    assert detect_format(mooncake) == "mooncake"
    assert [(r.time_s, r.prompt_tokens) for r in recs] == [(0.0, 6955), (3.0, 300), (3.0, 50)]


def test_bad_rows_name_the_file_line_and_column(tmp_path, mooncake):
    bad = tmp_path / "bad.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,lots,3\n")
    with pytest.raises(TraceError, match=r"bad\.csv:2: column 'ContextTokens'"):
        read_trace(bad)
    mooncake.write_text('{"timestamp": 1}\n')
    with pytest.raises(TraceError, match=r"mooncake\.jsonl:1"):
        read_trace(mooncake)
    unknown = tmp_path / "what.csv"
    unknown.write_text("a,b,c\n1,2,3\n")
    with pytest.raises(TraceError, match="format"):
        read_trace(unknown)


def test_analyze_reports_lengths_long_share_and_burstiness(mooncake):
    result = analyze(read_requests(mooncake), long_input_tokens=1000, window_s=1.0)
    assert result["num_requests"] == 3
    assert result["long_input_share"] == pytest.approx(1 / 3)
    assert result["long_input_token_share"] == pytest.approx(6955 / 7305)
    assert result["prompt_tokens"]["max"] == 6955
    assert result["prompt_histogram"]["4096-8191"] == 1
    # gaps 3.0 and 0.0: CV = std/mean = 1.5/1.5
    assert result["burstiness"]["interarrival_cv"] == pytest.approx(1.0)


def test_analyze_cli_on_the_azure_trace(capsys):
    from splitserve.cli import main

    assert main(["workload", "analyze", str(AZURE_TRACE), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["num_requests"] > 19000
    assert result["prompt_tokens"]["p50"] == pytest.approx(1020, abs=5)   # README: p50 1,020
    assert 0.5 < result["long_input_share"] < 0.56                         # README: 53% over 1,000
    assert 4.5 < result["burstiness"]["mean_rate"] < 6.5                   # README: about 5.5 req/s


def test_analyze_cli_names_a_missing_file(capsys):
    from splitserve.cli import main

    assert main(["workload", "analyze", "/nonexistent/trace.csv"]) == 2
    assert "not found" in capsys.readouterr().err


def test_analyze_reads_a_trials_request_log(tmp_path):
    plan = [{"index": i, "class": "chat", "send_at_s": 2.0 * i, "num_prompt_tokens": 100 * (i + 1),
             "max_tokens": 8} for i in range(12)]
    log = tmp_path / "results.json"
    log.write_text(json.dumps({"plan": plan}))
    result = analyze(read_requests(log), long_input_tokens=1000)
    assert result["num_requests"] == 12
    assert result["long_input_share"] == pytest.approx(3 / 12)      # 1000, 1100, 1200
    assert result["burstiness"]["interarrival_cv"] == pytest.approx(0.0)
    assert result["burstiness"]["mean_rate"] == pytest.approx(0.5)
