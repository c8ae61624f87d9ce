#!/usr/bin/env bash
# The packages splitserve needs that the GPU machine's image lacks, as wheels for its Python 3.12 on
# x86-64, into .whl/ (ignored by git; the device tool carries it: docs/benchmarks.md, "On a GPU").
# The image's torch, transformers, tokenizers, safetensors, numpy, httpx, prometheus-client, psutil,
# PyYAML, rich, matplotlib, jinja2, click, h11, idna, requests and tqdm are used as they are. The
# versions are this project's .venv's (what the suite runs against); typing-extensions and anyio
# travel because pydantic and starlette want newer ones than an image may hold. No xgrammar: the
# check sends no structured-output request. Run from anywhere: bash bench/gpu/fetch_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
WHEELS=(
  pyzmq==27.3.0 msgspec==0.23.0 gguf==0.19.0
  fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 opentelemetry-api==1.45.2 annotated-doc==0.0.7
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  typing-extensions==4.16.0 anyio==4.16.0
)
PLATFORMS=()
for tag in manylinux_2_39 manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 \
           manylinux_2_26 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
  PLATFORMS+=(--platform "${tag}_x86_64")
done
rm -rf .whl && mkdir -p .whl
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${PLATFORMS[@]}" --platform any -d .whl "${WHEELS[@]}"
count=$(ls .whl/*.whl | wc -l)
if [ "$count" -ne "${#WHEELS[@]}" ]; then
  echo "fetch_wheels: expected ${#WHEELS[@]} wheels, got $count" >&2; exit 1
fi
du -sh .whl
