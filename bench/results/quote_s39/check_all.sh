# Session 39: bench/planner_check.py of one profile against the four-spec rounds of sessions 34-38.
#   bash bench/results/quote_s39/check_all.sh PROFILE.json TAG [OUTDIR]   (from the repository root)
P=$1; tag=$2; out=${3:-bench/results/quote_s39}
for s in 34 35 36 37 38; do
  R="bench/results/quote_s$s/doc_heavy_bursty/results.json bench/results/quote_s$s/azure_replay/results.json bench/results/quote_s$s/mixed_service/results.json bench/results/quote_s$s/chat_only/results.json"
  .venv/bin/python bench/planner_check.py $P $R > $out/pc_${tag}_on_s$s.log 2>&1
  echo "$tag on s$s: $(grep -m1 'arrangement-runs predicted' $out/pc_${tag}_on_s$s.log | cut -c1-12)"
done
