

def test_workload_analyze_with_a_profile_adds_the_overlap_and_refuses_a_bad_profile(tmp_path, capsys):
    import argparse
    import pathlib

    from splitserve.trial import analyze

    root = pathlib.Path(__file__).resolve().parent.parent
    trace = tmp_path / "t.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                     "2023-11-16 18:15:46.0,2000,40\n2023-11-16 18:15:46.5,50,40\n2023-11-16 18:16:40.0,60,10\n")
    args = argparse.Namespace(file=str(trace), format="auto", long_input_tokens=1000, window_s=10.0,
                              json=False, profile=str(root / "examples/profile_accelerator_hand.json"), threads=1)
    assert analyze.run(args) == 0
    assert "arriving during a long prefill" in capsys.readouterr().out
    bad = tmp_path / "bad.json"
    bad.write_text('{"threads": 3}')
    args.profile = str(bad)
    assert analyze.run(args) == 2
    assert "workload analyze:" in capsys.readouterr().err
