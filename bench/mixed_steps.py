"""Issue 28: mixed steps (running decodes plus one fresh short prompt) timed in-process, as
`splitserve profile` times its own mixed samples, against a profile's step model.

The profile's grid times mixed steps only with 128- and 512-token prompts beside 8 decodes, where
its model fits within a few per cent; a served chat instance's prompt steps are almost all short
prompts beside decodes (bench/served_steps.py --traffic). This times that shape on a quiet box: B
requests decoding at a context, and each timed step also prefills a fresh prompt of P tokens.

    python bench/mixed_steps.py PROFILE.json [--batches 8,16] [--context 128] [--prompts 0,32,64,96,128,256]
        [--repeats 7] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as serve sets it for its engines

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("profile")
    ap.add_argument("--batches", default="8,16")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--prompts", default="0,32,64,96,128,256")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import torch

    from splitserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from splitserve.control.profile import StepTimer
    from splitserve.control.profile_file import load_profile
    from splitserve.control.stepmodel import StepShape
    from splitserve.engine.core import EngineCore
    from splitserve.models.loader import load_model

    torch.set_num_threads(1)
    model = load_profile(args.profile).instance_models([1])[0][0]
    batches = [int(x) for x in args.batches.split(",")]
    prompts = [int(x) for x in args.prompts.split(",")]
    core = EngineCore(EngineConfig(model=None, num_threads=1,
                                   cache=CacheConfig(kv_cache_memory=256 * 2**20, enable_prefix_caching=True),
                                   scheduler=SchedulerConfig(max_num_seqs=max(batches) + 2,
                                                             max_num_batched_tokens=max(prompts) + max(batches) + 64)),
                      load_model(None))
    timer = StepTimer(core, args.repeats, lambda *_: None, seed=3)
    rows = []
    try:
        for batch in batches:
            for p in prompts:
                timer.measure_decode(batch, args.context, args.repeats, new_prompt=p)
                s = timer.samples[-1]
                shape = StepShape(s["prefill_tokens"], s["prefill_attn_ktok2"], s["decode_seqs"], s["decode_kv_tokens"])
                predicted = model.predict(shape)
                best, median = min(s["seconds"]), statistics.median(s["seconds"])
                rows.append({**s, "model_s": predicted, "best_over_model": best / predicted,
                             "median_over_model": median / predicted})
                print(f"B={batch:3d} context={args.context} prompt={p:5d}: best {best * 1e3:7.1f} median "
                      f"{median * 1e3:7.1f} model {predicted * 1e3:7.1f} ms  best/model {best / predicted:.2f}  "
                      f"median/model {median / predicted:.2f}", flush=True)
    finally:
        core.close()
    if args.json:
        Path(args.json).write_text(json.dumps({"profile": args.profile, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
