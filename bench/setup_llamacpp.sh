#!/usr/bin/env bash
# Builds the llama.cpp baseline into its own venv, .venv-llamacpp (git-ignored), so that
# its numpy/pydantic/fastapi pins can never disturb the project's .venv.
#
# llama-cpp-python has no CPU wheel on PyPI: pip builds it from source (~7 minutes on a
# quiet 2-core machine, ~30 under load). GGML_NATIVE=ON tunes it for this CPU, but on
# Sapphire Rapids -march=native also turns on AMX tiles, and this sandbox does not grant
# the AMX state: the first matmul dies with SIGILL in `tileloadd`. So AMX is switched off
# explicitly; AVX-512, VNNI and BF16 stay on.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv-llamacpp
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
CMAKE_ARGS="-DGGML_NATIVE=ON '-DCMAKE_C_FLAGS=${NO_AMX}' '-DCMAKE_CXX_FLAGS=${NO_AMX}'" \
  MAKEFLAGS=-j2 CMAKE_BUILD_PARALLEL_LEVEL=2 \
  .venv-llamacpp/bin/pip install 'llama-cpp-python[server]==0.3.36'
.venv-llamacpp/bin/python -c "import llama_cpp; print(llama_cpp.llama_print_system_info().decode())"
