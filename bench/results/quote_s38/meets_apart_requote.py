import json, sys, glob
sys.path.insert(0, '.')
from splitserve.trial.quote import quote
paths = [r['results'] for r in json.load(open('bench/results/quote_s37/requote_reach.json'))]
paths += sorted(glob.glob('bench/results/quote_s37/*/results.json')) + sorted(glob.glob('bench/results/quote_s38/*/results.json'))
seen = set(); n = 0; out = []
for p in paths:
    if p in seen: continue
    seen.add(p)
    q = quote(json.load(open(p)))
    if q is None: continue
    n += 1
    r = q['ratio'] or {}
    others = [(o['target'], o['decision'], o['ratio'].get('meets_at_rps')) for o in q['other_targets'] if (o['ratio'] or {}).get('meets')]
    line = f"{p}: {q['decision']} lo={r.get('lo')} meets={r.get('meets')} at={r.get('meets_at_rps')} others={others}"
    print(line, flush=True)
print(f"{n} trials read")
