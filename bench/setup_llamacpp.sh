#!/usr/bin/env bash
# Builds the llama.cpp baseline into its own venv (default .venv-llamacpp, git-ignored; or the
# folder given as $1), so that its numpy/pydantic/fastapi pins can never disturb the project's .venv.
#
# llama-cpp-python has no CPU wheel on PyPI: pip builds it from source. Only the library and the
# Python server are needed, so llava/mtmd, tests, examples and tools are switched off (about 140
# compile steps; ~10 minutes on a quiet 2-core machine, ~40 at nice 19 on a busy one).
# GGML_NATIVE=ON tunes it for this CPU, but on Sapphire Rapids -march=native also turns on AMX
# tiles, and a sandbox may not grant the AMX state: the first matmul then dies with SIGILL in
# `tileloadd`. So AMX is switched off explicitly; AVX-512, VNNI and BF16 stay on.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv-llamacpp}"
python3 -m venv "$VENV"
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
-DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF '-DCMAKE_C_FLAGS=${NO_AMX}' '-DCMAKE_CXX_FLAGS=${NO_AMX}'" \
  MAKEFLAGS=-j2 CMAKE_BUILD_PARALLEL_LEVEL=2 \
  "$VENV/bin/pip" install 'llama-cpp-python[server]==0.3.36'
"$VENV/bin/python" -c "import llama_cpp; print(llama_cpp.llama_print_system_info().decode())"
