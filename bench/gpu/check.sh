#!/usr/bin/env bash
# The device check on a bare GPU machine of the lent kind (docs/benchmarks.md, "On a GPU"), from the
# repo root, with .whl/ (bench/gpu/fetch_wheels.sh) carried beside the working tree:
#     bash bench/gpu/check.sh            # results in $OUT (the device tool's), else ./gpu-check
# Installs the wheels into /tmp/site on top of the image's python3 (its torch, CUDA build and
# transformers), then runs check.py on cuda under a 480 s limit, so a hung section still leaves the
# JSON written so far and the log. Extra arguments go to check.py (e.g. --sections greedy).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT_DIR=${OUT:-gpu-check}
mkdir -p "$OUT_DIR"
PY=${PYTHON:-python3}
started=$(date +%s)
if ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "check.sh: installing the carried wheels failed" >&2; exit 3; }
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  echo "check.sh: no .whl/ here; using whatever $PY can import" >&2
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
echo "check.sh: wheels installed in $(( $(date +%s) - started )) s; $("$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())' 2>&1)"
timeout -k 10 480 "$PY" bench/gpu/check.py --device "${DEVICE:-cuda}" --out "$OUT_DIR" "$@" 2>&1 | tee "$OUT_DIR/check.log"
rc=${PIPESTATUS[0]}
echo "check.sh: done in $(( $(date +%s) - started )) s, check.py exit $rc"
exit "$rc"
