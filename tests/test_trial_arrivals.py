"""Arrival generators checked statistically: the rate they promise and the burstiness they promise."""
import numpy as np
import pytest

from splitserve.trial.arrivals import burstiness_stats, compress, generate_arrivals, interarrival_gaps
from splitserve.trial.spec import ArrivalSpec, Phase


def rng(seed=0):
    return np.random.default_rng(seed)


def times(arrivals):
    return np.asarray([a.time_s for a in arrivals])


def test_constant_arrivals_are_evenly_spaced():
    t = times(generate_arrivals(ArrivalSpec("constant", rate=4.0, num_requests=9), rng()))
    assert np.allclose(t, np.arange(9) * 0.25)
    assert burstiness_stats(t)["interarrival_cv"] == pytest.approx(0.0)


def test_poisson_has_the_asked_rate_and_cv_one():
    t = times(generate_arrivals(ArrivalSpec("poisson", rate=5.0, num_requests=8000), rng()))
    stats = burstiness_stats(t)
    assert stats["mean_rate"] == pytest.approx(5.0, rel=0.05)
    assert stats["interarrival_cv"] == pytest.approx(1.0, abs=0.05)


@pytest.mark.parametrize("cv", [0.5, 2.0, 4.0])
def test_gamma_has_the_asked_rate_and_burstiness(cv):
    gaps = interarrival_gaps("gamma", 2.0, 40000, rng(int(cv * 10)), burstiness=cv)
    assert 1 / gaps.mean() == pytest.approx(2.0, rel=0.08)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.12)


def test_burstier_gamma_has_a_higher_peak_to_mean_rate():
    calm = times(generate_arrivals(ArrivalSpec("gamma", rate=2.0, num_requests=3000, burstiness=0.5), rng(1)))
    bursty = times(generate_arrivals(ArrivalSpec("gamma", rate=2.0, num_requests=3000, burstiness=4.0), rng(1)))
    assert burstiness_stats(bursty)["peak_to_mean_rate"] > 2 * burstiness_stats(calm)["peak_to_mean_rate"]


def test_duration_bounds_the_arrivals():
    t = times(generate_arrivals(ArrivalSpec("poisson", rate=10.0, duration_s=200.0), rng()))
    assert t.max() < 200.0 and len(t) == pytest.approx(2000, rel=0.1)


def test_on_off_puts_bursts_of_documents_on_a_steady_chat_stream():
    spec = ArrivalSpec("on_off", rate=1.0, duration_s=600.0, quiet_class="chat", burst_class="document",
                       burst_every_s=60.0, burst_size=3, burst_spread_s=2.0)
    arrivals = generate_arrivals(spec, rng())
    docs = np.asarray([a.time_s for a in arrivals if a.class_name == "document"])
    chats = [a for a in arrivals if a.class_name == "chat"]
    assert len(docs) == 10 * 3                                   # bursts at 30, 90, ..., 570
    starts = docs.reshape(10, 3)
    assert np.all(starts.min(axis=1) >= np.arange(10) * 60 + 30)
    assert np.all(starts.max(axis=1) <= np.arange(10) * 60 + 32)
    assert len(chats) == pytest.approx(600, rel=0.1)
    assert list(times(arrivals)) == sorted(times(arrivals))


def test_phases_change_the_rate_during_the_run():
    spec = ArrivalSpec("phases", phases=[Phase(300.0, 1.0), Phase(300.0, 5.0, "gamma", 2.0)])
    t = times(generate_arrivals(spec, rng()))
    first, second = (t < 300).sum(), (t >= 300).sum()
    assert first / 300 == pytest.approx(1.0, rel=0.15)
    assert second / 300 == pytest.approx(5.0, rel=0.15)


def test_trace_replay_scales_time_samples_and_keeps_lengths(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(f'{{"timestamp": {1000 * i}, "input_length": {100 + i}, "output_length": 7}}\n'
                             for i in range(2000)))
    full = generate_arrivals(ArrivalSpec("trace", trace_path=trace, time_scale=2.0), rng())
    assert [a.time_s for a in full[:3]] == [0.0, 0.5, 1.0]
    assert (full[5].prompt_tokens, full[5].answer_tokens, full[5].class_name) == (105, 7, "short")
    half = generate_arrivals(ArrivalSpec("trace", trace_path=trace, sample=0.5), rng())
    assert len(half) == pytest.approx(1000, rel=0.08)
    clipped = generate_arrivals(ArrivalSpec("trace", trace_path=trace, start_s=10.0, num_requests=5,
                                            long_input_tokens=105, max_prompt_tokens=108), rng())
    assert [a.prompt_tokens for a in clipped] == [108, 108, 108, 108, 108]
    assert clipped[0].time_s == 0.0 and clipped[0].class_name == "long"


def test_one_seed_gives_identical_arrivals_and_compress_keeps_the_order():
    spec = ArrivalSpec("gamma", rate=3.0, num_requests=50, burstiness=2.0)
    a, b = generate_arrivals(spec, rng(7)), generate_arrivals(spec, rng(7))
    assert a == b
    fast = compress(a, 2.0)
    assert [x.time_s * 2 for x in fast] == pytest.approx([x.time_s for x in a])


def test_a_phase_mix_fixes_the_classes_and_never_moves_an_arrival():
    plain = ArrivalSpec("phases", phases=[Phase(200.0, 2.0), Phase(200.0, 1.0)])
    mixed = ArrivalSpec("phases", phases=[Phase(200.0, 2.0, mix={"chat": 9, "document": 1}),
                                          Phase(200.0, 1.0, mix={"document": 1})])
    a, b = generate_arrivals(plain, rng()), generate_arrivals(mixed, rng())
    assert np.array_equal(times(a), times(b)) and all(x.class_name is None for x in a)
    first = [x.class_name for x in b if x.time_s < 200]
    assert first.count("document") / len(first) == pytest.approx(0.1, abs=0.06)
    assert {x.class_name for x in b if x.time_s >= 200} == {"document"}
