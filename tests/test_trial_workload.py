"""Prompts are real text cut to exact token counts; one seed plans identical requests."""
import numpy as np
import pytest

from splitserve.trial.arrivals import Arrival, generate_arrivals
from splitserve.trial.spec import SpecError, parse_spec
from splitserve.trial.workload import PromptSource, bundled_text, plan_requests, workload_streams


def word_tokens(text):
    return [len(w) for w in text.split()]  # a stand-in tokenizer: one token per word


SPEC = parse_spec({
    "workload": {"classes": {"chat": {"prompt_tokens": {"dist": "uniform", "min": 5, "max": 40},
                                      "answer_tokens": 8},
                             "document": {"prompt_tokens": {"dist": "lognormal", "median": 1500, "min": 900,
                                                            "max": 3000},
                                          "answer_tokens": {"dist": "choice", "values": [16, 32]},
                                          "question": "What is this about?"}},
                 "mix": {"chat": 3, "document": 1}},
    "arrivals": {"pattern": "poisson", "rate": 2.0, "num_requests": 400},
    "slo": {"ttft_s": 1, "gap_s": 0.2, "max_pause_s": 1, "e2e_s": 10},
    "arrangements": [{"name": "a", "url": "http://127.0.0.1:1"}]})


def plan(seed, spec=SPEC):
    arrival_rng, content_rng = workload_streams(seed)
    return plan_requests(spec, generate_arrivals(spec.arrivals, arrival_rng), PromptSource(word_tokens),
                         content_rng)


def test_the_bundled_text_is_long_real_prose():
    text = bundled_text()
    assert len(text.split()) > 4000
    assert "When in the Course of human events" in text


def test_prompts_have_exactly_the_planned_length_and_end_with_the_question():
    requests = plan(1)
    question = word_tokens("What is this about?")
    for r in requests:
        dist = SPEC.classes[r.class_name].prompt_tokens
        assert dist.low <= r.num_prompt_tokens <= dist.high
        if r.class_name == "document":
            assert r.prompt_token_ids[-len(question):] == question
            assert r.max_tokens in (16, 32)
        else:
            assert r.max_tokens == 8


def test_the_mix_is_respected():
    share = np.mean([r.class_name == "document" for r in plan(2)])
    assert share == pytest.approx(0.25, abs=0.06)


def test_one_seed_plans_identical_requests_at_identical_times_and_another_does_not():
    a, b, c = plan(5), plan(5), plan(6)
    assert [(r.send_at_s, r.prompt_token_ids, r.max_tokens) for r in a] == \
           [(r.send_at_s, r.prompt_token_ids, r.max_tokens) for r in b]
    assert [r.send_at_s for r in a] != [r.send_at_s for r in c]


def test_prompts_longer_than_the_text_wrap_around():
    source = PromptSource(word_tokens, "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi "
                                       "omicron pi")
    prompt = source.prompt(40, np.random.default_rng(0))
    assert len(prompt) == 40 and set(prompt) <= set(source.stream)


def test_a_question_longer_than_the_prompt_is_refused():
    source = PromptSource(word_tokens)
    with pytest.raises(SpecError, match="prompt_tokens min"):
        source.prompt(3, np.random.default_rng(0), question="one two three four")


def test_trace_arrivals_keep_their_own_lengths():
    requests = plan_requests(SPEC, [Arrival(0.0, "long", 1234, 9)], PromptSource(word_tokens),
                             np.random.default_rng(0))
    assert (requests[0].num_prompt_tokens, requests[0].max_tokens, requests[0].class_name) == (1234, 9, "long")


def test_a_recut_plan_keeps_every_length_and_time_but_not_the_text():
    """Sweep replays and the warm-up get fresh prompt text (a server's prefix cache would
    otherwise skip their prefill), the same for every arrangement."""
    from splitserve.trial.workload import content_stream, recut

    base = plan(3)
    source = PromptSource(word_tokens)
    again = recut(base, SPEC, source, content_stream(3, 1))
    assert recut(base, SPEC, source, content_stream(3, 1)) == again  # every arrangement: the same
    assert [(r.index, r.class_name, r.send_at_s, r.num_prompt_tokens, r.max_tokens) for r in again] == \
           [(r.index, r.class_name, r.send_at_s, r.num_prompt_tokens, r.max_tokens) for r in base]
    differ = [a.prompt_token_ids != b.prompt_token_ids for a, b in zip(base, again)]
    assert np.mean(differ) > 0.9
    question = word_tokens("What is this about?")
    assert all(r.prompt_token_ids[-len(question):] == question for r in again if r.class_name == "document")
    warmup = recut(base, SPEC, source, content_stream(3, -1))
    assert np.mean([a.prompt_token_ids != b.prompt_token_ids for a, b in zip(warmup, again)]) > 0.9


def test_the_planner_simulates_exactly_the_requests_the_trial_plans():
    # one generator (request_shapes) for both: the same classes, send times, lengths and priorities
    from splitserve.control.predict import requests_from_spec

    for seed in (1, 7):
        spec = parse_spec({
            "seed": seed,
            "workload": {"classes": {"chat": {"prompt_tokens": {"dist": "uniform", "min": 5, "max": 40},
                                              "answer_tokens": {"dist": "uniform", "min": 4, "max": 12},
                                              "priority": -1},
                                     "document": {"prompt_tokens": {"dist": "lognormal", "median": 1500,
                                                                    "min": 900, "max": 3000},
                                                  "answer_tokens": 16, "question": "What is this about?"}},
                         "mix": {"chat": 3, "document": 1}},
            "arrivals": {"pattern": "poisson", "rate": 2.0, "num_requests": 200},
            "slo": {"ttft_s": 1, "gap_s": 0.2, "max_pause_s": 1, "e2e_s": 10},
            "arrangements": [{"name": "a", "url": "http://127.0.0.1:1"}]})
        trial = plan(seed, spec)
        planner = requests_from_spec(spec)
        assert [(r.index, r.class_name, r.send_at_s, r.num_prompt_tokens, r.max_tokens, r.priority or 0)
                for r in trial] == [(r.index, r.class_name, r.arrival_s, r.prompt_tokens, r.answer_tokens,
                                     r.priority) for r in planner]
        assert {r.class_name for r in trial} == {"chat", "document"}
        assert {r.priority for r in planner} == {-1, 0}
