"""Session 39, tried and not kept: refit each served entry of a profile on its samples divided by
the served pass's decode-only speed against the prior (the minute's box speed taken out, the
serving stack's prompt-step excess kept).

    .venv/bin/python bench/results/quote_s39/served_renorm.py PROFILE.json OUT.json
"""
import json, sys
from splitserve.control.online_stepmodel import OnlineStepModel, StepSample
from splitserve.control.stepmodel import StepShape, fit_step_model
from splitserve.control.profile_file import step_samples, CONTENDED_FIT_STATISTIC
src, dst = sys.argv[1], sys.argv[2]
doc = json.load(open(src))
for t, e in doc["threads"].items():
    s = e.get("served")
    if not s: continue
    n = s["instances"]
    source, stat = ((e["contended"], CONTENDED_FIT_STATISTIC) if n > 1 and "contended" in e else (e, "fastest"))
    prior = fit_step_model(*step_samples(source["samples"], "samples", stat)).model
    rows = [StepSample(StepShape(r[0], r[1], r[2], r[3]), r[5] if r[5] > 0 else r[4]) for r in s["samples"]]
    dec = [(x.seconds, prior.predict(x.shape)) for x in rows if not x.shape.prefill_tokens]
    speed = sum(a for a, _ in dec) / sum(b for _, b in dec)
    norm = [StepSample(x.shape, x.seconds / speed) for x in rows]
    o = OnlineStepModel(prior); o.refit(norm)
    s["step_model"] = o.model.to_dict()
    pr = [(x.seconds, prior.predict(x.shape)) for x in norm if x.shape.prefill_tokens]
    print(t, "decode speed", round(speed, 3), "prompt after", round(sum(a for a, _ in pr) / sum(b for _, b in pr), 3))
json.dump(doc, open(dst, "w"))
